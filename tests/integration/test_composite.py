"""Vision-language (composite) configs, estimated for text-only steps: the language model as any other, the vision
tower and projector held in the weights (quantized and LoRA-wrapped as transformers and peft do) but never run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memplan.estimator.breakdown import estimate
from memplan.model.catalog import load_spec
from memplan.model.trainable import lora_params, quantized_linears, trainable_params
from memplan.setup import Setup
from memplan.model.spec import ModelSpec

SHAPES = Path(__file__).resolve().parents[2] / "benchmarks" / "shapes"


def _copy(tmp_path, family: str) -> Path:
    path = tmp_path / family
    path.mkdir()
    shutil.copy(SHAPES / family / "config.json", path / "config.json")
    return path


@pytest.mark.parametrize("family, parts", [
    ("gemma3", ("model.multi_modal_projector", "model.vision_tower")),
    ("qwen2_5_vl", ("model.visual",)),
    # Mllama's cross-attention layers (text_config.cross_attention_layers 2 and 5) are skipped without an image
    ("mllama", ("model.language_model.layers.2", "model.language_model.layers.5", "model.multi_modal_projector",
                "model.vision_model")),
])
def test_the_inventory_splits_the_language_model_from_its_media_parts(family, parts):
    import transformers
    from accelerate import init_empty_weights

    spec = load_spec(str(SHAPES / family / "config.json"))
    assert spec.arch.auto_class == "AutoModelForImageTextToText" and spec.arch.media_parts == parts
    assert all(p.block is None and p.stack == "media" for p in spec.media)
    # nothing lost or counted twice: the two halves are the model transformers builds
    d = json.loads((SHAPES / family / "config.json").read_text())
    config = transformers.AutoConfig.for_model(**d)
    with init_empty_weights():
        model = transformers.AutoModelForImageTextToText.from_config(config)
    model.tie_weights()
    assert spec.numel_total == sum(p.numel() for p in model.parameters())
    assert {p.name for p in spec.params} | {p.name for p in spec.media} == {n for n, _ in model.named_parameters()}
    text_layers = d["text_config"]["num_hidden_layers"] - len(d["text_config"].get("cross_attention_layers", ()))
    assert spec.arch.num_decoder_layers == text_layers
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_media_parts_hold_weights_but_get_no_gradients_or_optimizer_state():
    spec = load_spec(str(SHAPES / "gemma3" / "config.json"))
    media = sum(p.numel for p in spec.media)
    full = Setup(technique="full", precision="bf16", optimizer="adamw", batch_size=1, seq_len=128)
    assert not {p.name for p in trainable_params(spec, full)} & {p.name for p in spec.media}
    e = estimate(spec, full)
    assert e.params_trainable == spec.numel_total - media
    assert e.components["weights"] >= spec.numel_total * 2  # every parameter resident, bf16
    assert e.components["optimizer_state"] == (spec.numel_total - media) * 2 * 2  # m and v for the text path only
    assert any("never run" in n and "model.vision_tower" in n for n in e.notes)


def test_qlora_quantizes_the_vision_tower_and_keeps_the_projector_weight():
    # transformers' bnb quantizer replaces every nn.Linear but the get_keys_to_not_convert ones: the vision tower's
    # too; Gemma-3's projector is an nn.Parameter (mm_input_projection_weight), not a Linear
    spec = load_spec(str(SHAPES / "gemma3" / "config.json"))
    names = {m.name for m in quantized_linears(spec)}
    assert {m.name for m in spec.media_linears} <= names
    assert "model.language_model.norm" == spec.arch.last_module


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_adapters_on_the_vision_tower_match_peft(tmp_path, targets):
    # peft's all-linear walks the whole model (tuners_utils._maybe_include_all_linear_layers) and a name such as
    # q_proj matches SigLIP's attention too: their adapters are resident, never trained
    import peft
    import transformers
    from accelerate import init_empty_weights

    path = _copy(tmp_path, "gemma3")
    spec = load_spec(str(path / "config.json"))
    config = transformers.AutoConfig.for_model(**json.loads((path / "config.json").read_text()))
    with init_empty_weights():
        model = transformers.AutoModelForImageTextToText.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=8, target_modules=targets if targets == "all-linear" else targets.split(",")))
    assert lora_params(spec, targets, 8) == model.get_nb_trainable_parameters()[0]
    setup = Setup(technique="lora", precision="bf16", lora_targets=targets, lora_r=8, batch_size=1, seq_len=128)
    e = estimate(spec, setup)
    media_adapters = lora_params(spec, targets, 8) - e.params_trainable
    assert media_adapters > 0  # counted in the adapters' bytes, not in what trains
    assert e.components["lora_adapters"] == lora_params(spec, targets, 8) * 4


def test_a_per_layer_attention_config_is_refused(tmp_path):
    # transformers' per_layer_config (Gemma-4: global layers at head_dim 512 beside sliding ones at 256) is not
    # modelled: refused rather than under-counted; a plain config's per_layer_config view is empty and passes
    from memplan.errors import BadInput
    from transformers import AutoConfig

    d = AutoConfig.for_model("gemma4").to_diff_dict()
    d["model_type"] = "gemma4"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(BadInput, match="per_layer_config"):
        load_spec(str(tmp_path / "config.json"))
