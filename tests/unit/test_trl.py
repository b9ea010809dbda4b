"""TRL's trainers (issue 38): Setup rules, the fused head's closed form, the phases each trainer adds, the CLI.

The trace agreement of these terms is pinned by the trainer= rows of benchmarks/matrices/trace_vs_estimate.yaml
(tests/integration/test_trace.py runs the quick ones); here, what can be checked without running a model.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memplan.cli.main import main
from memplan.errors import SetupError
from memplan.estimator.breakdown import estimate, estimator_for
from memplan.estimator.memory import fused_head
from memplan.estimator.memory.context import resolve
from memplan.estimator.trainers import rows_setup
from memplan.gpus import find_gpu
from memplan.model.catalog import load_spec
from memplan.setup import Setup

QWEN = "Qwen/Qwen2.5-0.5B"  # tied 151,936-row vocabulary: the logits dominate Trainer's step
TRL = dict(precision="bf16-mixed", grad_ckpt=True, batch_size=4, seq_len=512)


def test_grpo_batch_must_divide_into_prompts():
    with pytest.raises(SetupError, match=r"generation_batch_size \(3 x 1 accumulation x 1 GPUs = 3\) must be "
                                         r"divisible by num_generations \(8\).*--num-generations 3"):
        Setup(trainer="grpo", batch_size=3)
    assert Setup(trainer="grpo", batch_size=4, grad_accum=2).num_generations == 8  # 4 x 2 prompts' completions


@pytest.mark.parametrize("fields, words", [
    (dict(packing=True), "packing is a SFTConfig field: add --trainer sft"),
    (dict(trainer="dpo", num_generations=4), "num_generations is a GRPOConfig field"),
    (dict(trainer="grpo", batch_size=8, beta=-1.0), "beta must be >= 0"),
    (dict(trainer="grpo", batch_size=8, vllm_gpu_memory_utilization=1.5), "fraction of the card's memory"),
    (dict(trainer="sft", mode="infer"), "--trainer sft runs a training step"),
    (dict(trainer="sft", prompt_len=10), "--prompt-len applies to --mode infer only"),
    (dict(trainer="dpo", sharding="ddp", num_gpus=2), "modelled on one GPU"),
])
def test_trl_fields_refused_where_they_do_not_apply(fields, words):
    with pytest.raises(SetupError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Setup(**fields)


def test_prompt_len_is_a_dpo_and_grpo_field():
    assert Setup(trainer="dpo", prompt_len=128).prompt_len == 128
    assert Setup(trainer="grpo", prompt_len=128).prompt_len == 128


def test_rows_each_trainer_runs():
    spec = load_spec(QWEN)
    assert rows_setup(spec, Setup(trainer="dpo", **TRL)).batch_size == 8  # chosen and rejected
    grpo = rows_setup(spec, Setup(trainer="grpo", max_completion_length=64, prompt_len=100, num_generations=4, **TRL))
    assert grpo.seq_len == 164 and grpo.batch_size == 4
    packed = rows_setup(spec, Setup(trainer="sft", packing=True, **TRL))
    assert (packed.batch_size, packed.seq_len, packed.padded) == (1, 2048, True)  # sdpa: a block-diagonal mask


def test_fused_head_closed_form_by_hand():
    """SmolLM2-135M (hidden 576, vocabulary 49,152: two tiles, 32,768 and 16,384 wide), LoRA under bf16 autocast
    over fp32 weights, DPO on 2 pairs of 256 tokens with a 128-token prompt: N = 4 rows x 128 completion tokens."""
    s = Setup(trainer="dpo", technique="lora", prompt_len=128, precision="bf16-mixed", grad_ckpt=True, batch_size=2,
              seq_len=256)
    spec = load_spec("HuggingFaceTB/SmolLM2-135M")
    ctx = resolve(spec, rows_setup(spec, s))
    n, h = 4 * 128, 576
    assert fused_head.scored_tokens(ctx) == n
    tile = n * 32768 * 2
    # the backward binds w_chunk: the 32,768- and 16,384-row bf16 casts of the fp32 weight overlap; and the token
    # chunk's bf16 cast of the fp32 hidden states
    assert fused_head._tile_bytes(ctx, backward=True) == tile + (32768 + 16384) * h * 2 + n * h * 2
    assert fused_head._tile_bytes(ctx) == tile + 32768 * h * 2 + n * h * 2
    saved = n * h * 4 + n * (3 * 8 + 2 * 4) + 4 * 255 * (4 * 3 + 2)
    assert fused_head.saved_bytes(ctx) == saved
    # the head is frozen under LoRA: fp32 grad_hidden alone
    assert fused_head.backward_bytes(ctx) == saved + n * h * 4 + fused_head._tile_bytes(ctx, backward=True)


def test_sft_never_holds_the_logits():
    hf = estimate(QWEN, Setup(**TRL))
    sft = estimate(QWEN, Setup(trainer="sft", **TRL))
    assert hf.components["logits"] > 2**30  # 4 x 512 x 151,936 fp32 and their gradients
    assert sft.peak_allocated_bytes < hf.peak_allocated_bytes - 2**30
    assert "fused LM head" in " ".join(sft.notes)


def test_dpo_reference_strategies():
    full = estimate(QWEN, Setup(trainer="dpo", **TRL))
    assert full.components["reference_model"] == full.components["weights"]  # from_pretrained in the policy's dtype
    assert "reference_forward" in full.phases
    lora = estimate(QWEN, Setup(trainer="dpo", technique="lora", **TRL))
    assert lora.components["reference_model"] == 0 and "reference_forward" in lora.phases  # the adapter disabled
    pre = estimate(QWEN, Setup(trainer="dpo", precompute_ref_log_probs=True, **TRL))
    assert pre.components["reference_model"] == 0 and "reference_forward" not in pre.phases
    assert pre.peak_allocated_bytes < full.peak_allocated_bytes


def test_grpo_phases():
    g = dict(TRL, num_generations=4, max_completion_length=256)
    plain = estimate(QWEN, Setup(trainer="grpo", technique="lora", **g))
    assert {"generation_prefill", "generation_decode"} <= set(plain.phases) and "reference_forward" not in plain.phases
    beta = estimate(QWEN, Setup(trainer="grpo", technique="lora", beta=0.04, **g))
    assert "reference_forward" in beta.phases and beta.components["reference_model"] == 0
    full = estimate(QWEN, Setup(trainer="grpo", beta=0.04, **g))
    assert full.components["reference_model"] == full.components["weights"]
    server = estimate(QWEN, Setup(trainer="grpo", use_vllm=True, vllm_mode="server", **g))
    assert not any(p.startswith("generation") for p in server.phases)
    # longer completions grow the generation's KV cache and the policy's rows
    longer = estimate(QWEN, Setup(trainer="grpo", technique="lora", **{**g, "max_completion_length": 1024}))
    assert longer.peak_allocated_bytes > plain.peak_allocated_bytes


def test_colocated_vllm_takes_its_fraction_of_the_named_card():
    s = Setup(trainer="grpo", technique="lora", use_vllm=True, num_generations=4, **TRL)
    h100 = find_gpu("h100")
    e = estimator_for(h100)(QWEN, s)
    assert e.components["vllm_colocated"] == int(0.3 * h100.memory_bytes)
    assert e.device_total_bytes - e.peak_reserved_bytes >= e.components["vllm_colocated"]
    unnamed = estimate(QWEN, s)
    assert unnamed.components["vllm_colocated"] == 0 and any("--gpu" in n for n in unnamed.notes)


def test_cli_applies_trl_defaults_and_refuses_a_bad_grpo_batch():
    r = CliRunner().invoke(main, ["estimate", "gpt2", "--trainer", "sft", "--json"])
    assert r.exit_code == 0, r.output
    setup = json.loads(r.output)["setup"]
    assert (setup["precision"], setup["grad_ckpt"]) == ("bf16-mixed", True)  # TRL's bf16=True, checkpointing
    given = json.loads(CliRunner().invoke(main, ["estimate", "gpt2", "--trainer", "sft", "--precision", "fp32",
                                                 "--json"]).output)["setup"]
    assert given["precision"] == "fp32"
    bad = CliRunner().invoke(main, ["estimate", "gpt2", "--trainer", "grpo", "--batch-size", "3"])
    assert bad.exit_code == 2 and "divisible by num_generations" in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize("model, flags, words", [
    ("google-t5/t5-small", [], "this setup builds AutoModelForSeq2SeqLM"),
    ("Qwen/Qwen2.5-0.5B", ["--task", "seq-cls"], "this setup builds AutoModelForSequenceClassification"),
    ("gpt2", ["--added-tokens", "3"], "not modelled yet"),
])
def test_trl_refuses_what_it_does_not_model(model, flags, words):
    r = CliRunner().invoke(main, ["estimate", model, "--trainer", "sft", *flags])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output


def test_plan_keeps_grpo_batches_divisible_and_searches_dpo_reference():
    from memplan.planner.search import plan
    for g in (4, 8):
        p = plan("Qwen/Qwen2.5-1.5B", "rtx 4090", trainer="grpo", technique="lora", num_generations=g,
                 max_completion_length=256)
        assert p.fits and (p.setup.batch_size * p.setup.grad_accum) % g == 0
    # the accumulation pinned (the planner check pins 1): the micro-batch itself holds whole groups; this stopped
    # with "generation_batch_size (1 x 1 ...) must be divisible" before the search stepped in groups
    for ga, unit in ((1, 4), (2, 2)):
        p = plan("Qwen/Qwen2.5-0.5B", "rtx 3060", trainer="grpo", technique="lora", num_generations=4, grad_accum=ga,
                 max_completion_length=256, seq_len=256, replay=False)
        assert p.fits and p.setup.grad_accum == ga and p.setup.batch_size % unit == 0 and p.setup.batch_size > unit
    # full-fine-tuning DPO on a 12 GB card: a second copy of the weights does not fit beside the policy; the
    # precomputed reference (the same loss) does
    p = plan("Qwen/Qwen2.5-1.5B", "rtx 3060", trainer="dpo", technique="full")
    assert p.fits and p.setup.precompute_ref_log_probs
    assert any(a.setup.precompute_ref_log_probs is False for a in p.alternatives) or p.evaluated > 1


def test_steps_per_generation():
    """GRPO's generation batch is batch x steps_per_generation; below grad_accum generate() runs mid-window with the
    gradients alive; a count that does not divide grad_accum adds the old log-probs pass (grpo_trainer.py)."""
    g = dict(TRL, trainer="grpo", technique="full", grad_accum=4, num_generations=4, max_completion_length=256)
    default = estimate(QWEN, Setup(**g))
    each = estimate(QWEN, Setup(**g, steps_per_generation=1))
    assert "old_logps_forward" not in default.phases and "old_logps_forward" not in each.phases
    # one micro-batch's completions in the KV cache instead of four (about 0.1 GiB less), but the full model's
    # fp32 gradients (1.84 GiB) beside them
    assert each.phases["generation_decode"] - default.phases["generation_decode"] > 1.5 * 2**30
    odd = estimate(QWEN, Setup(**g, steps_per_generation=3))
    assert "old_logps_forward" in odd.phases
    with pytest.raises(SetupError, match=r"4 x 3 steps per generation x 1 GPUs = 12\) must be divisible by "
                                         r"num_generations \(8\)"):
        Setup(**{**g, "num_generations": 8}, steps_per_generation=3)
    with pytest.raises(SetupError, match="steps_per_generation is a GRPOConfig field"):
        Setup(trainer="sft", steps_per_generation=2)


def test_a_measured_grpo_row_reads_back():
    """A stored row's optional integer (steps_per_generation, '' when unset) reads back as an int: read as text, the
    GPU rows of 2026-11-27 stopped `memplan check` with a TypeError. A value of the wrong type is a SetupError that
    names the field (the GRPO batch rule skips what it cannot multiply)."""
    from memplan.measure.rows import make_row, setup_from_row
    s = Setup(trainer="grpo", technique="lora", batch_size=4, grad_accum=2, num_generations=4, steps_per_generation=3,
              max_completion_length=256, seq_len=128)
    assert setup_from_row(make_row(QWEN, s)) == s
    plain = Setup(trainer="grpo", batch_size=4, num_generations=4)
    assert setup_from_row(make_row(QWEN, plain)).steps_per_generation is None
    with pytest.raises(SetupError, match=r"steps_per_generation must be an integer from 1 to 1,048,576, got '3'"):
        Setup(trainer="grpo", batch_size=4, num_generations=4, steps_per_generation="3")


def test_trl_over_a_bitsandbytes_model_prepares_nothing_and_trains_bf16_adapters(tmp_path):
    """TRL 1.16's SFT/DPO/GRPO trainers call no prepare_model_for_kbit_training: the model keeps its 16-bit dtype
    (no fp32 upcast of the embeddings, norms and head) and the trainer casts the trainable adapters to bf16, DoRA's
    magnitude apart (sft_trainer.py, dpo_trainer.py, grpo_trainer.py: `if _is_quantized_model`). Trainer's QLoRA
    recipe keeps the upcast and fp32 adapters. The plan file loads the model as TRL would, unprepared."""
    from memplan.estimator.memory.weights import lora_bytes, lora_numel
    spec = load_spec("Qwen/Qwen2.5-7B")
    trl = resolve(spec, Setup(trainer="sft", technique="qlora", precision="bf16-mixed", grad_ckpt=True))
    hf = resolve(spec, Setup(technique="qlora", precision="bf16-mixed", grad_ckpt=True))
    assert (trl.weight_bytes, trl.residual_bytes, trl.adapter_bytes) == (2, 2, 2)
    assert (hf.weight_bytes, hf.residual_bytes, hf.adapter_bytes) == (4, 4, 4)
    assert lora_bytes(trl) == lora_numel(trl) * 2
    dora = resolve(spec, Setup(trainer="sft", technique="qlora", precision="bf16-mixed", use_dora=True))
    magnitude = sum(m.out_features for m in dora.lora)
    assert lora_bytes(dora) == (lora_numel(dora) - magnitude) * 2 + magnitude * 4
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", "Qwen/Qwen2.5-0.5B", "--gpu", "rtx 3060", "--trainer", "sft",
                                  "--technique", "qlora", "-o", str(out)])
    assert r.exit_code == 0, r.output
    import yaml
    model = yaml.safe_load(out.read_text())["model"]
    assert model["dtype"] == "bfloat16" and model["prepare_for_kbit_training"] is False
