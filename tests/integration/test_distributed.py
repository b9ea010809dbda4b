"""Multi-GPU estimates (DDP, ZeRO-1/2/3, FSDP, CPU offload): the ZeRO paper's model-state formulas, frozen
parameters, offload to host RAM, validation, fit/plan across GPUs and the emitted launcher configs."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from memplan.cli.main import main
from memplan.errors import SetupError
from memplan.estimator.breakdown import estimate
from memplan.gpus import find_gpu
from memplan.estimator.memory.distributed import NCCL_DEVICE_BYTES
from memplan.model.catalog import load_spec
from memplan.setup import Setup
from memplan.units import GiB

LLAMA7 = "meta-llama/Llama-2-7b-hf"


def _states(e) -> int:
    """weights + gradients + optimizer state at the optimizer step (the model states of the ZeRO paper)."""
    import memplan.estimator.breakdown as est
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.memory.distributed import compute_setup
    ctx = resolve(load_spec(e.model), e.setup)
    phases, _ = est.sharded_phases(ctx, resolve(ctx.spec, compute_setup(e.setup)))
    step = phases["optimizer_step"]
    return step["weights"] + step["gradients"] + step["optimizer_state"]


@pytest.mark.parametrize("sharding, per_param", [
    # ZeRO paper (arXiv:1910.02054) sec. 5.1 / Fig. 1, mixed-precision Adam (K = 12): bytes per parameter per GPU
    ("zero1", lambda n: 2 + 2 + 12 / n),
    ("zero2", lambda n: 2 + (2 + 12) / n),
    ("zero3", lambda n: (2 + 2 + 12) / n),
])
@pytest.mark.parametrize("n", [8, 64])
def test_zero_model_states_match_the_paper(sharding, per_param, n):
    spec = load_spec(LLAMA7)
    e = estimate(spec, Setup(technique="full", precision="bf16-mixed", optimizer="adamw-fused", sharding=sharding,
                             num_gpus=min(n, 8), num_nodes=max(1, n // 8)))
    expected = per_param(n) * spec.numel_total
    persistent = 0
    if sharding == "zero2":  # the contiguous gradient buffer also covers the tensor cut by the partition boundary
        persistent = 2 * max(p.numel for p in spec.params)
    if sharding == "zero3":  # parameters below stage3_param_persistence_threshold (10 x hidden) stay whole
        persistent = sum(p.numel for p in spec.params if p.numel < 10 * spec.arch.hidden_size) * 2 * (1 - 1 / n)
    assert _states(e) == pytest.approx(expected + persistent, rel=1e-3)


def test_ddp_keeps_replicas_and_gradient_buckets():
    spec = load_spec(LLAMA7)
    one = estimate(spec, Setup(technique="lora", precision="bf16", batch_size=2))
    ddp = estimate(spec, Setup(technique="lora", precision="bf16", batch_size=2, sharding="ddp", num_gpus=4))
    grads = one.components["gradients"] if one.peak_phase != "forward" else 0
    assert ddp.components["comm_buffers"] > 0
    assert ddp.components["nccl_buffers"] == NCCL_DEVICE_BYTES
    # the same step on every rank: one GPU's peak + the buckets (as large as the adapter gradients)
    assert ddp.peak_allocated_bytes - one.peak_allocated_bytes == ddp.components["comm_buffers"]
    assert grads in (0, ddp.components["comm_buffers"])


def test_frozen_parameters_carry_no_sharded_optimizer_state():
    """DeepSpeed's estimator counts every parameter as trainable (DeepSpeed issue #5304); LoRA under ZeRO-3 keeps
    optimizer state for the adapters only."""
    spec = load_spec(LLAMA7)
    full = estimate(spec, Setup(technique="full", precision="bf16-mixed", sharding="zero3", num_gpus=8))
    lora = estimate(spec, Setup(technique="lora", precision="bf16-mixed", sharding="zero3", num_gpus=8))
    assert lora.params_trainable < spec.numel_total / 100
    assert _states(lora) < _states(full) / 5


def test_offload_moves_optimizer_state_to_host_ram():
    spec = load_spec(LLAMA7)
    s = Setup(technique="full", precision="bf16-mixed", sharding="zero3", num_gpus=4, grad_ckpt=True)
    gpu = estimate(spec, s)
    opt = estimate(spec, Setup(**{**s.to_dict(), "offload": "optimizer"}))
    both = estimate(spec, Setup(**{**s.to_dict(), "offload": "params+optimizer"}))
    assert opt.components["optimizer_state"] == 0 and gpu.host_bytes == 0
    # fp32 master + Adam moments (12 B) + the fp32 gradient partition (4 B) per trainable parameter, / N
    assert opt.host_bytes == pytest.approx(16 * spec.numel_total / 4, rel=1e-3)
    assert both.host_bytes > opt.host_bytes and both.device_total_bytes < opt.device_total_bytes < gpu.device_total_bytes
    assert opt.to_dict()["host_bytes_per_node"] == 4 * opt.host_bytes


@pytest.mark.parametrize("sharding", ["zero3", "fsdp-full-shard", "zero2"])
def test_per_gpu_memory_never_grows_with_more_gpus(sharding):
    spec = load_spec("meta-llama/Llama-3.2-1B")
    totals = [estimate(spec, Setup(technique="full", precision="bf16-mixed", sharding=sharding, num_gpus=n,
                                   batch_size=2, seq_len=1024)).device_total_bytes for n in (2, 4, 8)]
    assert totals[0] > totals[1] > totals[2]


@pytest.mark.parametrize("model, fields", [
    ("google-t5/t5-base", dict(technique="lora", lora_targets="all-linear", precision="bf16", attn_impl="eager",
                               grad_ckpt=True, seq_len=256, target_len=64)),
    ("tiiuae/falcon-7b", dict(technique="full", precision="bf16-mixed", grad_ckpt=True, seq_len=1024)),
    ("google-t5/t5-small", dict(technique="full", precision="bf16-mixed", attn_impl="eager", seq_len=128)),
])
@pytest.mark.parametrize("sharding", ["zero3", "fsdp-full-shard", "ddp"])
def test_every_single_gpu_phase_has_a_per_rank_view(model, fields, sharding):
    """Each phase training_phases makes (the encoder's backward, the softmax moments, the decoder embedding's) gets
    its gathered parameters and gradients under data parallelism: a phase missing from the map was a KeyError."""
    from memplan.estimator.memory.context import resolve
    from memplan.estimator.phases import training_phases

    spec = load_spec(model)
    setup = Setup(sharding=sharding, num_gpus=2, batch_size=2, **fields)
    single = training_phases(resolve(spec, Setup(batch_size=2, **fields)))
    assert set(estimate(spec, setup).phases) == set(single)


def test_fsdp_keeps_fp32_shards_and_gathers_16bit_units():
    spec = load_spec(LLAMA7)
    e = estimate(spec, Setup(technique="full", precision="bf16-mixed", sharding="fsdp-full-shard", num_gpus=8,
                             grad_ckpt=True))
    assert e.components["weights"] == pytest.approx(4 * spec.numel_total / 8, rel=1e-6)
    sgo = estimate(spec, Setup(technique="full", precision="bf16-mixed", sharding="fsdp-shard-grad-op", num_gpus=8,
                               grad_ckpt=True))
    # shard-grad-op keeps every unit unsharded (bf16) between its forward and its backward
    assert sgo.peak_allocated_bytes - e.peak_allocated_bytes > 1.5 * spec.numel_total


@pytest.mark.parametrize("fields, message", [
    (dict(num_gpus=2), "data-parallel strategy"),
    (dict(sharding="ddp", offload="optimizer"), "needs DeepSpeed ZeRO or FSDP"),
    (dict(sharding="zero2", offload="params+optimizer"), "stage 3"),
    (dict(sharding="fsdp-full-shard", offload="optimizer"), "offload params"),
    (dict(sharding="zero3", optimizer="adamw-8bit"), "bitsandbytes"),
    (dict(mode="infer", sharding="zero3"), "multi-GPU inference"),
    (dict(sharding="zero4"), "zero4"),
    (dict(num_gpus=0, sharding="ddp"), "num_gpus"),
])
def test_invalid_distributed_setups_say_how_to_fix(fields, message):
    with pytest.raises(SetupError, match=message):
        Setup(**fields)


def test_cli_estimate_rejects_bad_sharding_with_exit_2():
    r = CliRunner().invoke(main, ["estimate", "gpt2", "--num-gpus", "4"])
    assert r.exit_code == 2 and "--sharding" in r.output and "Traceback" not in r.output


def test_fit_llama2_70b_on_a100_reports_gpu_counts():
    """The issue's example: how many A100 80GB cards full fine-tuning needs with ZeRO-3 and with FSDP, and what
    LoRA and QLoRA need per GPU."""
    r = CliRunner().invoke(main, ["fit", "meta-llama/Llama-2-70b-hf", "--gpu", "A100 80GB", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["option"]: row for row in json.loads(r.output)["multi_gpu"]}
    zero3, fsdp = rows["full fine-tune, DeepSpeed ZeRO-3"], rows["full fine-tune, FSDP full shard"]
    for row in (zero3, fsdp):
        assert 8 < row["gpus"] <= 64 and row["need_bytes_at_batch_1"] <= 80 * GiB
        assert row["setup"]["num_gpus"] * row["setup"]["num_nodes"] == row["gpus"]
    assert rows["QLoRA nf4, DDP"]["gpus"] == 1
    assert rows["LoRA r=8 on a bf16 base, DDP"]["gpus"] == 0  # a 138 GB bf16 replica never fits 80 GB
    assert 1 < rows["LoRA r=8 on a bf16 base, FSDP full shard"]["gpus"] <= 8


def test_fit_with_num_gpus_evaluates_that_count():
    r = CliRunner().invoke(main, ["fit", "meta-llama/Llama-2-70b-hf", "--gpu", "A100 80GB", "--num-gpus", "4"])
    assert r.exit_code == 0 and "on 4 x" in r.output


def test_plan_across_gpus_writes_launcher_configs(tmp_path):
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", LLAMA7, "--gpu", "RTX 4090", "--technique", "full", "--num-gpus", "4",
                                  "--sharding", "zero3", "-o", str(out)])
    assert r.exit_code == 0, r.output
    doc = yaml.safe_load(out.read_text())
    setup = doc["memplan"]["setup"]
    assert setup["sharding"] == "zero3" and setup["num_gpus"] == 4
    acc = yaml.safe_load((tmp_path / "plan.accelerate.yaml").read_text())
    ds = json.loads((tmp_path / "plan.deepspeed.json").read_text())
    assert acc == doc["accelerate"] and ds == doc["deepspeed"]
    assert acc["distributed_type"] == "DEEPSPEED" and acc["num_processes"] == 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_micro_batch_size_per_gpu"] == setup["batch_size"]
    assert ds["train_batch_size"] == setup["batch_size"] * setup["grad_accum"] * 4


def test_plan_finds_the_fewest_gpus_when_one_is_not_enough():
    from memplan.planner.search import plan
    p = plan(load_spec(LLAMA7), find_gpu("RTX 3060"), technique="full", host_memory="64GiB")
    assert p.fits and p.setup.world_size > 1 and "fewest" in p.suggestions[0]
    assert p.estimate.cap_need_bytes <= p.budget_bytes
    fewer = plan(load_spec(LLAMA7), find_gpu("RTX 3060"), technique="full", host_memory="64GiB",
                 num_gpus=p.setup.world_size // 2)
    assert not fewer.fits


# ---------------------------------------------------------------------------------------------- against the tracer

@pytest.mark.slow
@pytest.mark.parametrize("model, sharding", [
    ("HuggingFaceTB/SmolLM2-135M", "fsdp-full-shard"),
    ("meta-llama/Llama-3.2-1B", "fsdp-full-shard"),
    ("HuggingFaceTB/SmolLM2-135M", "fsdp-shard-grad-op"),
])
def test_fsdp_estimate_within_5_percent_of_the_fake_process_group_trace(model, sharding):
    """Rank 0 of real torch FSDP2 (fully_shard per block + root, accelerate's bf16 policy) over a fake process group
    of 8, 3 and 4 blocks extrapolated to the full depth (memplan.tracer.sharded: asked for 2, it traces at least
    MIN_SHARDED_BLOCKS; the same as the whole model's trace here). Measured 2026-11-25: SmolLM2 -0.0% (full shard) /
    +1.2% (shard-grad-op), Llama-3.2-1B -0.6%."""
    from memplan.tracer.training import comparable_estimate_bytes
    from memplan.tracer.sharded import trace_sharded

    s = Setup(technique="full", precision="bf16-mixed", optimizer="adamw-fused", sharding=sharding, num_gpus=8,
              batch_size=2, seq_len=256)
    traced = trace_sharded(model, s, layers=2)
    predicted = comparable_estimate_bytes(estimate(model, s))
    assert predicted == pytest.approx(traced.peak_tensor_bytes, rel=0.05)
    spec = load_spec(model)
    # the sharded state alone: parameters / 8 (fp32 shards) and Adam's two moments
    assert traced.components["weights"] == pytest.approx(4 * spec.numel_total / 8, rel=0.01)
    assert traced.components["optimizer_state"] == pytest.approx(8 * spec.numel_total / 8, rel=0.01)


@pytest.mark.parametrize("model, fields, tolerance", [
    # the loss's backward holds the root and the one block its pre-backward prefetches; autocast stays on over the
    # 16-bit parameters: T5's CrossEntropyLoss keeps a bf16 log_softmax, nll_loss's fp32 cast and an fp32 gradient
    # (-17% before)
    ("google-t5/t5-base", dict(technique="full", precision="bf16-mixed", sharding="fsdp-full-shard", num_gpus=4,
                               batch_size=4, seq_len=512, grad_ckpt=True), 0.01),
    # LoRA adapters run in the 16-bit param dtype: no fp32 copy of their input (+7.8% before)
    ("meta-llama/Llama-3.2-1B", dict(technique="lora", precision="bf16", sharding="fsdp-full-shard", num_gpus=8,
                                     batch_size=2, seq_len=1024), 0.01),
    # gelu_new under autocast on 16-bit input: pow in fp32 (-3.4% before)
    ("openai-community/gpt2-xl", dict(technique="freeze", trainable="2", precision="bf16-mixed",
                                      sharding="fsdp-full-shard", num_gpus=4, batch_size=4, seq_len=512), 0.01),
    # no sharded gradient exists before the last block's backward ends (+10.7% before)
    ("microsoft/phi-2", dict(technique="full", precision="bf16", optimizer="adamw", sharding="fsdp-shard-grad-op",
                             num_gpus=2, batch_size=2, seq_len=512, attn_impl="eager"), 0.02),
])
def test_fsdp_paths_found_by_the_sharded_tracer(model, fields, tolerance):
    """FSDP rows of a stress run against trace_sharded (real torch FSDP2 over a fake process group), 3 and 4 blocks
    extrapolated (equal to the whole model's trace on these)."""
    from memplan.tracer.training import compare
    from memplan.tracer.sharded import trace_sharded

    s = Setup(**fields)
    c = compare(trace_sharded(model, s, layers=3), estimate(model, s))
    assert abs(c["rel_error"]) < tolerance, c


def test_cli_trace_sharded_and_refuses_ddp():
    r = CliRunner().invoke(main, ["trace", "HuggingFaceTB/SmolLM2-135M", "--technique", "full", "--precision",
                                  "bf16-mixed", "--sharding", "fsdp-full-shard", "--num-gpus", "4", "--batch-size",
                                  "1", "--seq-len", "64", "--layers", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert d["comparison"]["rel_error"] == pytest.approx(0, abs=0.1)
    r = CliRunner().invoke(main, ["trace", "gpt2", "--sharding", "ddp", "--num-gpus", "4"])
    assert r.exit_code == 2 and "without --sharding" in r.output


def _cut(tmp_path, model: str, layers: int) -> str:
    """A config.json of `model` with `layers` blocks (the ZeRO trace runs real tensors: small models only)."""
    from memplan.model.catalog import config_dict
    d = config_dict(load_spec(model))
    d["num_hidden_layers"] = layers
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["TinyLlama/TinyLlama-1.1B-Chat-v1.0", "HuggingFaceTB/SmolLM2-135M",
                                   "meta-llama/Llama-3.2-1B"])
def test_zero3_estimate_within_2_percent_of_the_deepspeed_trace(tmp_path, model):
    """Rank 0 of real DeepSpeed ZeRO-3 (deepspeed.initialize with the JSON memplan writes, torch AdamW) on its CPU
    accelerator over a fake process group of 4 (memplan.tracer.sharded.trace_deepspeed), models cut to 4 blocks.
    Measured 2026-11-25: TinyLlama +0.0%, SmolLM2-135M (tied embedding) +0.2%; Llama-3.2-1B cut to 4 blocks +0.2%
    (-0.7% / -4.3% / -5.0% before ZeRO-3's persistent gradient-partition buffer was counted in the forward and the
    loss's and head's backward, the tied table's whole gradient at its backward, and the gathered bytes capped at the
    model's)."""
    pytest.importorskip("deepspeed")
    from memplan.tracer.training import comparable_estimate_bytes
    from memplan.tracer.sharded import trace_deepspeed

    config = _cut(tmp_path, model, 4)
    s = Setup(technique="full", precision="bf16-mixed", optimizer="adamw-fused", sharding="zero3", num_gpus=4,
              batch_size=2, seq_len=64)
    traced = trace_deepspeed(config, s)
    assert comparable_estimate_bytes(estimate(config, s)) == pytest.approx(traced.peak_tensor_bytes, rel=0.02)
    # after the step: 16-bit partition + fp32 master + Adam moments + the 16-bit gradient buffer, each / 4
    assert traced.phases["optimizer"] > 16 * load_spec(config).numel_total / 4
