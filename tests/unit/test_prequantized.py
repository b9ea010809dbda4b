"""Pre-quantized checkpoints served (issue 40): the stored formats' bytes, the uploads' ids, the card's kernels.

The traced agreement is pinned by the quant=gptq-int4/gptq-int8/awq/fp8 inference rows of
benchmarks/matrices/trace_vs_estimate.yaml; here the closed forms by hand and the user-facing rules.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner

from memplan.cli.main import main
from memplan.errors import SetupError
from memplan.estimator.breakdown import estimate, estimator_for
from memplan.estimator.memory.weights import alloc_bytes, prequantized_state_bytes
from memplan.gpus import find_gpu
from memplan.model.catalog import load_spec
from memplan.setup import Setup


def test_state_bytes_of_one_linear_by_hand():
    """A 4096 x 11008 Linear (Llama-2-7B's gate_proj, in x out), group size 128 (32 groups of the 4096 inputs)."""
    k, n = 4096, 11008
    workspace = alloc_bytes(132 * 4)  # Marlin's per-layer int32 workspace
    assert prequantized_state_bytes("gptq-int4", k, n) == alloc_bytes(32 * n * 2) + workspace  # fp16 scales only
    # AWQ keeps its packed zeros: int32 [groups, n x 4 / 32]
    assert prequantized_state_bytes("awq", k, n) == alloc_bytes(32 * n * 2) + alloc_bytes(32 * 1376 * 4) + workspace
    # FP8: one fp32 scale per 128 x 128 block of the [n, k] weight
    assert prequantized_state_bytes("fp8", k, n) == alloc_bytes(math.ceil(n / 128) * 32 * 4)


@pytest.mark.parametrize("upload, quant, per_weight", [
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "gptq-int4", 0.5), ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "gptq-int8", 1.0),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", "awq", 0.5), ("Qwen/Qwen3-8B-FP8", "fp8", 1.0)])
def test_uploads_resolve_to_their_base_and_format(upload, quant, per_weight):
    spec = load_spec(upload)
    assert spec.checkpoint_quant == quant and spec.variant_of
    stored = estimate(spec, Setup(mode="infer", precision="bf16", quant=quant, batch_size=1, new_tokens=1))
    full = estimate(spec.variant_of, Setup(mode="infer", precision="bf16", batch_size=1, new_tokens=1))
    quantized = sum(m.in_features * m.out_features for m in spec.linears if m.block is not None)
    # the blocks' Linear weights shrink from 2 bytes to the format's; everything else is the same
    assert stored.components["weights"] == pytest.approx(full.components["weights"] - quantized * (2 - per_weight),
                                                         rel=1e-3)


def test_compressed_tensors_fp8_upload_serves_and_refuses_training():
    r = CliRunner().invoke(main, ["estimate", "RedHatAI/Llama-3.1-8B-Instruct-FP8-Dynamic"])
    assert r.exit_code == 2 and "dequantize=True" in " ".join(r.output.split())
    r = CliRunner().invoke(main, ["estimate", "RedHatAI/Llama-3.1-8B-Instruct-FP8-Dynamic", "--mode", "infer"])
    assert r.exit_code == 0 and "use_optimized_inference=True" in " ".join(r.output.split())


def test_fp8_loads_dequantized_below_compute_capability_8_9():
    s = Setup(mode="infer", precision="bf16", quant="fp8", batch_size=1, new_tokens=1)
    h100 = estimator_for(find_gpu("h100"))("Qwen/Qwen3-8B-FP8", s)
    rtx3060 = estimator_for(find_gpu("rtx 3060"))("Qwen/Qwen3-8B-FP8", s)
    bf16 = estimate("Qwen/Qwen3-8B", Setup(mode="infer", precision="bf16", batch_size=1, new_tokens=1))
    assert rtx3060.components["weights"] == bf16.components["weights"] > h100.components["weights"]
    assert any("dequantized" in n for n in rtx3060.notes)


def test_lora_on_mxfp4_is_refused_with_the_dequantized_alternative():
    with pytest.raises(SetupError, match="Mxfp4Config"):
        Setup(technique="lora", quant="mxfp4", precision="bf16")
    r = CliRunner().invoke(main, ["estimate", "openai/gpt-oss-20b", "--technique", "lora", "--quant", "mxfp4",
                                  "--precision", "bf16"])
    assert r.exit_code == 2 and "drop --quant mxfp4" in " ".join(r.output.split())


def test_lora_on_awq_names_what_peft_and_transformers_refuse():
    with pytest.raises(SetupError, match="name the modules"):  # peft's all-linear matches no gptqmodel layer
        Setup(technique="lora", quant="awq", precision="fp16-mixed", lora_targets="all-linear")
    with pytest.raises(SetupError, match="AwqLoraLinear"):
        Setup(technique="lora", quant="awq", precision="fp16-mixed", use_dora=True)
    for precision in ("bf16", "bf16-mixed", "fp32"):  # transformers loads AWQ in fp16 on CUDA
        with pytest.raises(SetupError, match="--precision fp16-mixed"):
            Setup(technique="lora", quant="awq", precision=precision)
    r = CliRunner().invoke(main, ["estimate", "Qwen/Qwen2.5-7B-Instruct-AWQ", "--technique", "lora",
                                  "--precision", "fp16-mixed", "--grad-ckpt", "--format", "json"])
    assert r.exit_code == 0, r.output


def test_awq_training_layout_and_kernel_temporaries_by_hand():
    """gptqmodel's AwqGEMMLinear on Llama-2-7B's largest Linear (4096 x 11008, groups of 128): qzeros int32
    [32, 1376] and fp16 scales [32, 11008] beside qweight, no Marlin workspace. Its forward dequantizes the [k, n]
    weight to fp16 above 1024 rows (batch x tokens), else keeps 8 fp32 split-K partials [8, t, n]; its backward
    dequantizes again and repeats the transposed weight once per batch row."""
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.quant import backward_dequant_bytes, dequant_temp_bytes
    k, n = 4096, 11008
    assert prequantized_state_bytes("awq", k, n, training=True) == alloc_bytes(32 * n * 2) + alloc_bytes(32 * 1376 * 4)
    spec = load_spec("meta-llama/Llama-2-7b-hf")

    def ctx(b, s):
        return resolve(spec, Setup(technique="lora", quant="awq", precision="fp16-mixed", batch_size=b, seq_len=s))
    assert dequant_temp_bytes(ctx(4, 512)) == k * n * 2
    assert dequant_temp_bytes(ctx(2, 512)) == 8 * 1024 * n * 4  # 1024 rows: the split-K GEMM
    assert backward_dequant_bytes(ctx(4, 512)) == k * n * 2 * (1 + 4)
    inference = resolve(spec, Setup(mode="infer", quant="awq", precision="fp16"))
    assert backward_dequant_bytes(inference) == 0


def test_awq_layers_save_their_fp16_input():
    """AwqGemmFn saves its input whatever trains: with LoRA on q and v only, k, o and the MLP's Linears save an
    fp16 copy of their (fp32, upcast by peft's k-bit preparation) input too. Without checkpointing, Llama-2-7B's
    32 blocks: the first block's k (its input carries no gradient) is left out."""
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.saves import awq_saves
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    c = resolve(spec, Setup(technique="lora", quant="awq", precision="fp16-mixed", batch_size=1, seq_len=256))
    saving = {m.name.split(".")[-1] for m in spec.linears if awq_saves(c, m.name)}
    assert saving == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not awq_saves(c, "model.layers.0.self_attn.k_proj") and awq_saves(c, "model.layers.1.self_attn.k_proj")
    assert not awq_saves(c, "lm_head")


def test_lora_on_gptq_names_what_peft_refuses():
    with pytest.raises(SetupError, match="name the modules"):  # peft's all-linear matches no QuantLinear
        Setup(technique="lora", quant="gptq-int4", lora_targets="all-linear")
    with pytest.raises(SetupError, match="DoRA"):
        Setup(technique="lora", quant="gptq-int4", use_dora=True)
    r = CliRunner().invoke(main, ["estimate", "openai-community/gpt2", "--technique", "lora", "--quant", "gptq-int4",
                                  "--precision", "fp16"])
    assert r.exit_code == 2 and "LayerNorm" in r.output  # the fp32 stream under autocast is not modelled


def test_gptq_training_layout_by_hand():
    """The trainable TritonV2 layout of a 4096 x 11008 Linear: int32 qzeros [32, 11008 x 4 / 32], fp16 scales
    [32, 11008], int32 g_idx [4096]; no Marlin workspace."""
    k, n = 4096, 11008
    assert prequantized_state_bytes("gptq-int4", k, n, training=True) == \
        alloc_bytes(32 * 1376 * 4) + alloc_bytes(32 * n * 2) + alloc_bytes(k * 4)
    assert prequantized_state_bytes("gptq-int8", k, n, training=True) == \
        alloc_bytes(32 * 2752 * 4) + alloc_bytes(32 * n * 2) + alloc_bytes(k * 4)


def test_lora_on_gptq_keeps_the_16_bit_weights_and_dequantizes_one_layer_at_a_time():
    # peft's prepare_model_for_kbit_training skips the fp32 upcast for quantization_method "gptq" (bitsandbytes
    # bases are upcast); gptqmodel's training path unpacks the whole weight for each matmul (the largest:
    # Llama-2-7B's MLP, 4096 x 11008): int32 codes, int8 codes, gathered scales, the fp16 product, 6 bytes per
    # weight at most; the matmul saves the 2-byte product where a graph is recorded
    def weights(technique, quant, mode):
        train = dict(technique=technique, seq_len=512, grad_ckpt=True) if mode == "train" else {}
        return estimate("meta-llama/Llama-2-7b-hf", Setup(mode=mode, quant=quant, precision="fp16", batch_size=1,
                                                          **train))
    gptq, served = weights("lora", "gptq-int4", "train"), weights("full", "gptq-int4", "infer")
    assert gptq.components["weights"] == served.components["weights"]
    assert weights("qlora", "nf4", "train").components["weights"] > weights("full", "nf4", "infer").components["weights"]
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.quant import dequant_temp_bytes
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    assert dequant_temp_bytes(resolve(spec, gptq.setup)) == 4096 * 11008 * 6  # checkpointed: nothing saved
    unsaved = dataclasses.replace(gptq.setup, grad_ckpt=False)
    assert dequant_temp_bytes(resolve(spec, unsaved)) == 4096 * 11008 * 4  # the product is the saved copy
    assert dequant_temp_bytes(resolve(spec, served.setup)) == 0  # Marlin multiplies the packed weight


def test_fms_gptq_lora_row_is_estimated():
    """fms-acceleration's GPTQ-LoRA on an A100-80GB (shared/reference F08: refs/a100_80gb.csv @24bdadb,
    mem_peak_torch_mem_alloc_in_bytes 16,404,148,736 B; transformers 4.48.1): Mistral-7B GPTQ 4-bit, LoRA r=16 on
    q/k/v/o with dropout 0.1, fp16, AdamW, batch 4 x 4096 tokens, checkpointing, flash attention 2. Within 3%
    (estimated -0.5% on 2026-11-27); the plugin's AutoGPTQ Triton kernel dequantizes inside its tiles, where the
    gptqmodel kernel memplan models holds one layer's fp16 weight (0.11 GiB) more."""
    from memplan import libs
    s = Setup(technique="lora", quant="gptq-int4", precision="fp16", lora_r=16, lora_alpha=16, lora_dropout=0.1,
              lora_targets="q_proj,k_proj,v_proj,o_proj", optimizer="adamw", batch_size=4, seq_len=4096,
              grad_ckpt=True, attn_impl="flash_attention_2")
    with libs.assume(transformers="4.48.1"):
        e = estimate("TheBloke/Mistral-7B-v0.1-GPTQ", s)
    assert e.peak_allocated_bytes == pytest.approx(16_404_148_736, rel=0.03)


def test_fit_serves_an_upload_as_stored():
    r = CliRunner().invoke(main, ["fit", "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "--gpu", "rtx 3060", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)  # the upload's note goes to stderr
    assert [o["option"] for o in d["options"]] == ["inference gptq-int4 (as stored)",
                                                    "LoRA r=8 on the gptq-int4 base (checkpointing)"]
    assert all(o["fits"] for o in d["options"]) and d["multi_gpu"] == []
    r = CliRunner().invoke(main, ["fit", "Qwen/Qwen2.5-7B-Instruct-AWQ", "--gpu", "rtx 3060", "--json"])
    options = json.loads(r.stdout)["options"]
    assert [o["option"] for o in options] == ["inference awq (as stored)", "LoRA r=8 on the awq base (checkpointing)"]
    assert options[1]["setup"]["precision"] == "fp16-mixed"  # transformers loads AWQ in fp16 on CUDA


def test_gpt_oss_serves_its_mxfp4_experts_as_stored():
    """gpt-oss-20b (24 blocks of 32 experts, hidden 2880, intermediate 2880): the experts' weights at 4.25 bits
    (two E2M1 values per byte, an E8M0 scale per 32: transformers Mxfp4GptOssExperts), their biases in fp32, the
    rest bf16 - the 16 GB claim of OpenAI's model card."""
    s = Setup(mode="infer", precision="bf16", quant="mxfp4", batch_size=1, prompt_len=512, new_tokens=16)
    bf16 = estimate("openai/gpt-oss-20b", Setup(mode="infer", precision="bf16", batch_size=1, prompt_len=512,
                                                new_tokens=16))
    mx = estimate("openai/gpt-oss-20b", s)
    spec = load_spec("openai/gpt-oss-20b")
    w = sum(p.numel for p in spec.params if p.role == "expert" and len(p.shape) == 3)
    b = sum(p.numel for p in spec.params if p.role == "expert" and len(p.shape) == 2)
    assert w == 24 * 32 * 2880 * (5760 + 2880)
    expected = bf16.components["weights"] - w * (2 - 0.5 - 1 / 32) + b * (4 - 2)
    assert mx.components["weights"] == pytest.approx(expected, abs=2)
    assert mx.peak_allocated_bytes < 14 * 2**30
    r = CliRunner().invoke(main, ["fit", "openai/gpt-oss-20b", "--gpu", "RTX 4060 Ti 16GB", "--json"])
    rows = {o["option"]: o for o in json.loads(r.stdout)["options"]}
    assert rows["inference mxfp4 (as stored)"]["fits"] and not rows["inference bf16"]["fits"]


def test_mxfp4_is_served_only_and_only_on_gpt_oss_experts():
    with pytest.raises(SetupError, match="dequantize=True"):
        Setup(technique="lora", quant="mxfp4")
    r = CliRunner().invoke(main, ["estimate", "Qwen/Qwen3-8B", "--mode", "infer", "--quant", "mxfp4"])
    assert r.exit_code == 2 and "gpt-oss" in r.output
    # below compute capability 7.5 transformers dequantizes the experts to bf16
    s = Setup(mode="infer", precision="fp16", quant="mxfp4", batch_size=1, new_tokens=1)
    v100 = estimator_for(find_gpu("v100"))("openai/gpt-oss-20b", s)
    t4 = estimator_for(find_gpu("t4"))("openai/gpt-oss-20b", s)
    assert v100.components["weights"] > 2.5 * t4.components["weights"]
    assert any("dequantized" in n for n in v100.notes)



def test_a_local_config_loads_as_its_quantization_config_says(tmp_path):
    """transformers loads a config.json's quantization_config as that format: memplan uses it without --quant."""

    from memplan.model.catalog import DATA, stored_quant
    config = json.loads((DATA / "configs" / "Qwen__Qwen2.5-0.5B.json").read_text())
    assert stored_quant({**config, "quantization_config": {"quant_method": "gptq", "bits": 8}}) == "gptq-int8"
    assert stored_quant({**config, "quantization_config": {"quant_method": "gptq", "bits": 3}}) is None
    assert stored_quant({**config, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                           "bnb_4bit_quant_type": "nf4"}}) == "nf4"
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    r = CliRunner().invoke(main, ["estimate", str(path), "--mode", "infer", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["setup"]["quant"] == "gptq-int4"
    r = CliRunner().invoke(main, ["estimate", str(path), "--technique", "lora"])
    assert r.exit_code == 2 and "--precision fp16 or bf16" in r.output


def test_lora_on_fp8_follows_transformers_fp8_linear_function():
    """transformers 5.22's FP8LinearFunction gives FP8Linear (an nn.Linear, so all-linear finds it) a backward: the
    weight cast to the gradient's dtype and the block scales repeated over their rows. The model trains as loaded,
    in 16 bit (no k-bit preparation), and bf16-mixed builds the same bf16 model as bf16."""
    from memplan import libs
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.quant import backward_dequant_bytes
    Setup(technique="lora", quant="fp8", precision="bf16", lora_targets="all-linear")
    with pytest.raises(SetupError, match="DoRA"):
        Setup(technique="lora", quant="fp8", precision="bf16", use_dora=True)
    with pytest.raises(SetupError, match="--precision bf16"):
        Setup(technique="lora", quant="fp8", precision="fp32")
    spec = load_spec("meta-llama/Llama-2-7b-hf")
    pure = resolve(spec, Setup(technique="lora", quant="fp8", precision="bf16", batch_size=2, seq_len=128))
    mixed = resolve(spec, Setup(technique="lora", quant="fp8", precision="bf16-mixed", batch_size=2, seq_len=128))
    assert pure.weight_bytes == mixed.weight_bytes == pure.residual_bytes == 2
    k, n = 11008, 4096  # down_proj [in, out]: 32 x 86 blocks of 128 x 128
    assert backward_dequant_bytes(pure) == (n * k + 32 * 86 + 32 * 128 * 86) * 2
    with libs.assume(transformers="5.21.0"):
        r = CliRunner().invoke(main, ["estimate", "meta-llama/Llama-2-7b-hf", "--technique", "lora", "--quant", "fp8",
                                      "--precision", "bf16"])
    assert r.exit_code == 2 and "no backward" in r.output


def test_torchao_checkpoints_by_hand_and_by_config():
    """torchao 0.18's weight-only tensors as TorchAoConfig loads them: Int8Tensor (per row) keeps an fp32 scale and
    an int8 zero point per output row beside the int8 [n, k] data; Int4Tensor (plain packing) a 16-bit scale and
    zero point per group of 128 inputs. A config.json's quantization_config names them (TorchAoConfig.to_dict:
    quant_type {"default": torchao's config_to_dict})."""
    from memplan.model.catalog import stored_quant
    k, n = 4096, 11008
    assert prequantized_state_bytes("torchao-int8", k, n) == alloc_bytes(n * 4) + alloc_bytes(n)
    assert prequantized_state_bytes("torchao-int4", k, n) == 2 * alloc_bytes(32 * n * 2)
    int4 = {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_version": 2,
                                                                  "_data": {"group_size": 128}}}}
    int8 = {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_version": 2,
                                                                  "_data": {"granularity": {"_type": "PerRow"}}}}}
    assert stored_quant({"quantization_config": int4}) == "torchao-int4"
    assert stored_quant({"quantization_config": int8}) == "torchao-int8"
    int4["quant_type"]["default"]["_data"]["group_size"] = 32
    assert stored_quant({"quantization_config": int4}) == "torchao-int4"  # with --group-size 32 (stored_group_size)
    int4["quant_type"]["default"]["_data"]["group_size"] = 48
    assert stored_quant({"quantization_config": int4}) is None  # not a group size the kernels take


def test_lora_on_torchao_follows_peft():
    """peft's TorchaoLoraLinear trains on int8 weights only; prepare_model_for_kbit_training exempts torchao from the
    fp32 upcast, and the int8 linear saves the weight cast to the input's dtype, as a GPTQ base's torch path does."""
    from memplan.estimator.memory.context import resolve
    with pytest.raises(SetupError, match="int8 weights only"):
        Setup(technique="lora", quant="torchao-int4", precision="bf16")
    with pytest.raises(SetupError, match="DoRA"):
        Setup(technique="lora", quant="torchao-int8", precision="bf16", use_dora=True)
    ctx = resolve(load_spec("Qwen/Qwen2.5-0.5B"), Setup(technique="lora", quant="torchao-int8", precision="bf16",
                                                       lora_targets="all-linear"))
    assert ctx.weight_bytes == ctx.residual_bytes == 2
    r = CliRunner().invoke(main, ["fit", "Qwen/Qwen2.5-7B-Instruct-int8wo", "--gpu", "rtx 4090", "--json"])
    assert [o["option"] for o in json.loads(r.stdout)["options"]] == [
        "inference torchao-int8 (as stored)", "LoRA r=8 on the torchao-int8 base (checkpointing)"]


def test_compressed_tensors_fp8_is_served_with_its_row_quantization():
    """An -FP8-Dynamic upload (llm-compressor's FP8_DYNAMIC: float 8-bit weights per channel, activations per token)
    served by transformers' CompressedTensorsFP8Linear: an fp32 scale per output channel; the input quantized per row
    in torch ops, 12 bytes per element of the largest quantized Linear's input beside it (Mistral-7B's down_proj reads
    14336 values per token). Inference only; below compute capability 8.9 the weights decompress to 16 bit."""
    from memplan import libs
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.inference import prefill_working_bytes
    from memplan.model.catalog import stored_quant
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    assert stored_quant({"quantization_config": ct}) == "fp8-dynamic"
    ct["config_groups"]["group_0"]["weights"]["type"] = "int"  # W8A8 int8: not modelled
    assert stored_quant({"quantization_config": ct}) is None
    assert prequantized_state_bytes("fp8-dynamic", 4096, 11008) == alloc_bytes(11008 * 4)
    with pytest.raises(SetupError, match="dequantize=True"):
        Setup(technique="lora", quant="fp8-dynamic", precision="bf16")
    spec = load_spec("mistralai/Mistral-7B-v0.1")
    s = Setup(mode="infer", quant="fp8-dynamic", precision="bf16", batch_size=2, prompt_len=1024, new_tokens=8)
    t = 2 * 1024
    # PREFILL_HIDDEN hidden states, then the gated product and its fp32 quantization copies
    assert prefill_working_bytes(resolve(spec, s)) >= (2 + 12) * 14336 * t
    with libs.assume(compute_capability="8.6"):
        assert not resolve(spec, s).quantized  # decompressed to 16 bit on an A10 / RTX 3090


def test_plan_for_serving_proposes_the_most_faithful_checkpoint_that_fits():
    """plan --mode infer (issue 40): Mistral-7B on an RTX 3060 12GB at batch 8 x (512 + 128): the 16-bit checkpoint
    does not fit, an 8-bit GPTQ upload does; FP8 is offered only from compute capability 8.9 (an H100's 9.0)."""
    r = CliRunner().invoke(main, ["plan", "mistralai/Mistral-7B-v0.1", "--gpu", "rtx 3060", "--mode", "infer",
                                  "--batch-size", "8", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["choice"]["quant"] == "gptq-int8" and d["options"][0]["quant"] is None
    assert d["options"][0]["max_batch"] < 8 <= d["choice"]["max_batch"]
    assert "fp8" not in [o["quant"] for o in d["options"]]
    h100 = json.loads(CliRunner().invoke(main, ["plan", "mistralai/Mistral-7B-v0.1", "--gpu", "h100", "--mode",
                                                "infer", "--json"]).stdout)
    assert [o["quant"] for o in h100["options"]][:2] == [None, "fp8"] and h100["choice"]["quant"] is None
    upload = json.loads(CliRunner().invoke(main, ["plan", "Qwen/Qwen2.5-7B-Instruct-AWQ", "--gpu", "rtx 3060",
                                                  "--mode", "infer", "--json"]).stdout)
    assert [o["quant"] for o in upload["options"]] == ["awq"]
    # fused experts (transformers 5 MoE) are no Linears: a quantized upload's experts are not modelled
    moe = json.loads(CliRunner().invoke(main, ["plan", "Qwen/Qwen3-30B-A3B", "--gpu", "h100", "--mode", "infer",
                                               "--json"]).stdout)
    assert [o["quant"] for o in moe["options"]] == [None]
    oss = json.loads(CliRunner().invoke(main, ["plan", "openai/gpt-oss-20b", "--gpu", "rtx 4090", "--mode", "infer",
                                               "--json"]).stdout)
    assert oss["choice"]["quant"] == "mxfp4" and [o["quant"] for o in oss["options"]] == ["mxfp4", None]
    r = CliRunner().invoke(main, ["plan", "mistralai/Mistral-7B-v0.1", "--gpu", "rtx 3060", "--mode", "infer",
                                  "--batch-size", "4096"])
    assert r.exit_code == 1 and r.output.startswith("does not serve")
    r = CliRunner().invoke(main, ["plan", "gpt2", "--gpu", "rtx 3060", "--mode", "infer", "-o", "x.yaml"])
    assert r.exit_code == 2 and "serving plan is printed" in r.output


def test_group_size_sets_the_scales_and_comes_from_the_config():
    """GPTQConfig / AwqConfig / Int4WeightOnlyConfig group_size: a 4096 x 11008 Linear at group 32 holds 128 groups of
    fp16 scales (and AWQ's packed zeros), at -1 one per output column. A config.json names it."""
    from memplan.model.catalog import stored_group_size
    k, n = 4096, 11008
    assert prequantized_state_bytes("awq", k, n, training=True, group=32) == \
        alloc_bytes(128 * n * 2) + alloc_bytes(128 * 1376 * 4)
    assert prequantized_state_bytes("gptq-int4", k, n, group=-1) == alloc_bytes(n * 2) + alloc_bytes(132 * 4)
    with pytest.raises(SetupError, match="group_size must be one of"):
        Setup(mode="infer", quant="gptq-int4", group_size=48)
    with pytest.raises(SetupError, match="group_size applies to"):
        Setup(mode="infer", quant="fp8", group_size=32)
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    assert stored_group_size(gptq) == 32
    assert stored_group_size({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}) is None
    small = estimate("Qwen/Qwen2.5-0.5B", Setup(mode="infer", quant="gptq-int4", group_size=32, precision="bf16"))
    default = estimate("Qwen/Qwen2.5-0.5B", Setup(mode="infer", quant="gptq-int4", precision="bf16"))
    assert small.components["quant_state"] > default.components["quant_state"]
