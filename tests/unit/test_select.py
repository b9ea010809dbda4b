"""LoRA targeting, freezing and quantized-module selection, checked against peft / transformers themselves."""
from __future__ import annotations

import json

import pytest

from memplan.errors import BadInput, NotFound
from memplan.model.catalog import CONFIGS, load_spec
from memplan.model.trainable import lora_linears, lora_params, quantized_linears, trainable_params
from memplan.setup import Setup


def _small(tmp_path, stem: str, **overrides):
    """A catalog config cut down to 2 layers (fast to build), saved as a local config.json."""
    cfg = json.loads((CONFIGS / f"{stem}.json").read_text())
    cfg.update(overrides)
    path = tmp_path / stem
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _peft_trainable(config_dir, targets, r: int) -> int:
    """peft's own count: get_peft_model on the real class built on the meta device."""
    import peft
    import transformers
    from accelerate import init_empty_weights

    from memplan.model.catalog import read_config
    from memplan.model.hf import auto_class

    d = read_config(config_dir / "config.json")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "auto_map"})
    with init_empty_weights():
        model = auto_class(d, config).from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=targets))
    trainable, _ = model.get_nb_trainable_parameters()
    return trainable


CASES = [
    ("meta-llama__Llama-2-7b-hf", {"num_hidden_layers": 2}, None, 8),
    ("meta-llama__Llama-2-7b-hf", {"num_hidden_layers": 2}, "all-linear", 16),
    ("openai-community__gpt2", {"n_layer": 2}, None, 8),  # Conv1D c_attn
    ("openai-community__gpt2", {"n_layer": 2}, "all-linear", 4),
    ("google-t5__t5-small", {"num_layers": 2, "num_decoder_layers": 2}, None, 8),
    ("google-bert__bert-base-uncased", {"num_hidden_layers": 2}, "all-linear", 8),
    ("facebook__bart-base", {"encoder_layers": 2, "decoder_layers": 2}, ["q_proj", "v_proj", "fc1"], 8),
    ("mistralai__Mixtral-8x7B-v0.1", {"num_hidden_layers": 2}, "all-linear", 8),
    ("tiiuae__falcon-7b", {"num_hidden_layers": 2}, None, 8),
]


@pytest.mark.slow
@pytest.mark.parametrize("stem,overrides,targets,r", CASES)
def test_lora_count_matches_peft(tmp_path, stem, overrides, targets, r):
    path = _small(tmp_path, stem, **overrides)
    spec = load_spec(path)
    ours = lora_params(spec, targets if not isinstance(targets, list) else tuple(targets), r)
    assert ours == _peft_trainable(path, targets, r)


def test_unknown_lora_target_lists_modules():
    with pytest.raises(NotFound) as info:
        lora_linears(load_spec("meta-llama/Llama-2-7b-hf"), ("q_prj",))
    assert "q_proj" in str(info.value)


def test_freeze_defaults_to_last_block_of_the_head_stack():
    t5 = load_spec("google-t5/t5-small")
    last = trainable_params(t5, Setup(technique="freeze"))
    assert {(p.stack, p.block) for p in last} == {("decoder", 5)}
    llama = load_spec("meta-llama/Llama-2-7b-hf")
    two = trainable_params(llama, Setup(technique="freeze", trainable=2))
    assert {p.block for p in two} == {30, 31}
    assert sum(p.numel for p in two) == 2 * 202_383_360  # one Llama-2-7B block: 4*4096^2 + 3*4096*11008 + 2*4096
    heads = trainable_params(llama, Setup(technique="freeze", trainable=("lm_head", "model.norm")))
    assert {p.name for p in heads} == {"lm_head.weight", "model.norm.weight"}
    with pytest.raises(BadInput, match="match no parameter"):
        trainable_params(llama, Setup(technique="freeze", trainable=("nonexistent",)))


def test_quantized_modules_skip_the_output_head():
    llama = load_spec("meta-llama/Llama-2-7b-hf")
    q = quantized_linears(llama)
    assert len(q) == 32 * 7 and not any(m.name == "lm_head" for m in q)
    gpt2 = load_spec("gpt2")
    assert all(m.kind == "conv1d" for m in quantized_linears(gpt2))  # transformers converts Conv1D too


def test_comma_separated_lora_targets_become_module_names_everywhere():
    """peft reads a string target as one full-name regex (tuners_utils.check_target_module_exists), so "q,v" from
    the Python API must be split like the CLI splits it: the estimate, the tracer/validate model and the exported
    LoraConfig all see module names."""
    from memplan.planner.export import peft_section
    from memplan.model.catalog import load_spec
    from memplan.setup import Setup

    s = Setup(technique="lora", lora_targets="c_attn, c_proj")
    assert s.lora_targets == ("c_attn", "c_proj")
    assert Setup(technique="lora", lora_targets="ALL-LINEAR").lora_targets == "all-linear"
    assert Setup(technique="freeze", trainable="3").trainable == 3
    assert peft_section(load_spec("gpt2"), s)["target_modules"] == ["c_attn", "c_proj"]


_MOE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 1000, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
#: Qwen2-MoE: fused experts, but peft converts nothing (all-linear adapts its shared expert's Linears and the shared
#: gate); Qwen3-MoE and OLMoE: peft moves the old names onto the fused experts and the router; dots1: a dense first
#: block and shared experts whose gate_proj/up_proj/down_proj peft then leaves unadapted; Mixtral: the router by "gate"
_MOE_CASES = [
    ("qwen2_moe", {"num_experts": 4, "shared_expert_intermediate_size": 256}, "all-linear"),
    ("qwen3_moe", {"num_experts": 4}, "all-linear"),
    ("qwen3_moe", {"num_experts": 4}, ["q_proj", "gate_proj", "up_proj"]),
    ("olmoe", {"num_experts": 4}, ["v_proj", "down_proj", "gate"]),
    ("dots1", {"n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
               "topk_group": 1}, "all-linear"),
    ("mixtral", {"num_local_experts": 4}, ["q_proj", "gate"]),
]


@pytest.mark.parametrize("model_type, extra, targets", _MOE_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_lora_on_fused_experts_matches_peft(tmp_path, model_type, extra, targets):
    # a hand-kept {"mixtral"} missed every other family peft converts: OLMoE-shaped LoRA all-linear -20.9% (tracer)
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **_MOE, **extra}))
    spec = load_spec(path)
    mine = lora_params(spec, targets if isinstance(targets, str) else ",".join(targets), 8)
    assert mine == _peft_trainable(path, targets, 8)


def test_part_of_a_fused_expert_tensor_is_refused(tmp_path):
    path = tmp_path / "qwen3_moe"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **_MOE, "num_experts": 4}))
    with pytest.raises(BadInput, match="gate_proj and up_proj"):
        lora_linears(load_spec(path), ("q_proj", "gate_proj"))


def test_fused_expert_targets_follow_the_peft_release():
    """peft moves LoRA targets onto transformers-5 fused experts from 0.19 (select.PEFT_MOE_CONVERSION_SINCE): under
    0.18.1 all-linear adapts Mixtral's attention alone (traced under transformers 5.8.1: 91,653 MiB, the estimate
    91,652; with 0.21.0 181,434 MiB), 0.19.x fails on all-linear there, and the memoized estimate terms are keyed by
    the release (an estimate under one assumed peft does not answer for another)."""
    from memplan import libs
    from memplan.estimator.breakdown import estimate

    spec = load_spec("mistralai/Mixtral-8x7B-v0.1")
    with libs.assume(peft="0.18.1"):
        old = lora_linears(spec, "all-linear")
        assert {m.short_name for m in old} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with libs.assume(peft="0.19.1"):
        with pytest.raises(BadInput, match="upgrade peft to 0.20"):
            lora_linears(spec, "all-linear")
        assert {m.kind for m in lora_linears(spec, "q_proj,gate")} == {"linear", "router"}
    with libs.assume(peft="0.21.0"):
        new = lora_linears(spec, "all-linear")
        assert {m.kind for m in new} == {"linear", "router", "expert"}
    setup = Setup(technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=128)
    peaks = {}
    for v in ("0.21.0", "0.18.1", "0.21.0"):
        with libs.assume(peft=v):
            peaks.setdefault(v, set()).add(estimate(spec.model_id, setup).peak_allocated_bytes)
    assert len(peaks["0.21.0"]) == 1 and peaks["0.18.1"] != peaks["0.21.0"]
    assert next(iter(peaks["0.21.0"])) > 1.9 * next(iter(peaks["0.18.1"]))
