"""plan(): probe order with a fake estimator, the budget property on real models, pins, nothing-fits, plan files."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memplan.cli.main import main
from memplan.planner.export import load_plan
from memplan.gpus import Gpu, find_gpu
from memplan.estimator.memory.overhead import CUDA_CONTEXT_BYTES
from memplan.model.catalog import load_spec
from memplan.planner.search import plan, split_batch
from memplan.units import GiB

# --------------------------------------------------------------------------------------------- fake estimator


@dataclass
class _FakeEstimate:
    device_total_bytes: int
    params_trainable: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0

    @property
    def cap_need_bytes(self) -> int:  # no live/reserved split in the fake: the device total is what must fit
        return self.device_total_bytes


@dataclass
class _FakeSpec:
    model_id: str = "fake"
    numel_total: int = 1000

    class arch:  # noqa: N801 - mimics Arch's attributes the search reads
        kind = "causal"


#: bytes per sample and fixed bytes per technique (full is the largest), arbitrary but ordered like real models
_FIXED = {"full": 60 * GiB, "freeze": 20 * GiB, "lora": 16 * GiB, "qlora": 6 * GiB}


def _fake(calls: list):
    def estimator(spec, s):
        calls.append((s.technique, s.precision, s.lora_r, s.lora_targets, s.optimizer, s.grad_ckpt, s.batch_size))
        per = (GiB // 4 if s.grad_ckpt else GiB) * s.batch_size
        return _FakeEstimate(_FIXED[s.technique] + per, params_trainable=1000 if s.technique == "full" else 0)
    return estimator


def test_probe_order_quality_first_then_binary_search():
    """Full fine-tuning candidates are probed first (each rejected at batch 1 with one estimate), then LoRA with
    all-linear targets at rank 16 (issue 42 item 5: any rank from 16 up is as good with every layer adapted, QLoRA
    sec. 4; the memory goes to the micro-batch); the micro-batch is found by doubling then bisection."""
    calls: list = []
    gpu = Gpu("fake 24", 24 * GiB)
    p = plan(_FakeSpec(), gpu, seq_len=512, estimator=_fake(calls), replay=False)  # the closed form's probes
    assert p.setup.technique == "lora" and p.setup.lora_r == 16 and p.setup.lora_targets == "all-linear"
    assert p.setup.precision == "bf16-mixed" and p.setup.optimizer == "adamw-fused"
    full = [c for c in calls if c[0] == "full"]
    assert calls[: len(full)] == full and len(full) == 3 * 4 * 2  # precisions x optimizers x ckpt
    lora = [c for c in calls if c[0] == "lora"]
    assert lora[0] == ("lora", "bf16-mixed", 16, "all-linear", "adamw-fused", False, 1)
    budget = p.budget_bytes
    # no checkpointing: 16 GiB + b GiB fits for b <= 5; checkpointing: 16 + b/4 fits up to b = 22 -> 16 x 2
    assert p.setup.grad_ckpt and (p.setup.batch_size, p.setup.grad_accum) == (16, 2)
    assert _FIXED["lora"] + p.setup.batch_size * GiB // 4 <= budget


def test_full_probes_are_single_estimates_at_batch_1():
    calls: list = []
    plan(_FakeSpec(), Gpu("fake 24", 24 * GiB), estimator=_fake(calls))
    assert all(c[-1] == 1 for c in calls if c[0] == "full")


def test_budget_is_memory_minus_headroom_of_usable():
    gpu = Gpu("fake 80", 80 * GiB)
    p = plan(_FakeSpec(), gpu, estimator=_fake([]), headroom=0.1)
    usable = 80 * GiB - CUDA_CONTEXT_BYTES
    assert p.usable_bytes == usable and p.headroom_bytes == int(usable * 0.1)
    assert p.budget_bytes == 80 * GiB - int(usable * 0.1)
    assert p.setup.technique == "full" and p.estimate.cap_need_bytes <= p.budget_bytes


@pytest.mark.parametrize("eff,bmax,expected", [(32, 12, (8, 4)), (32, 32, (32, 1)), (32, 64, (32, 1)),
                                               (30, 7, (6, 5)), (31, 5, (5, 7)), (1, 1, (1, 1))])
def test_split_batch(eff, bmax, expected):
    assert split_batch(eff, bmax) == expected


# --------------------------------------------------------------------------------------------- real estimator

@pytest.mark.parametrize("gpu,technique", [("RTX 3060", "qlora"), ("A100 80GB", "full")])
def test_llama2_7b_plans_named_in_the_issue(gpu, technique):
    p = plan(load_spec("meta-llama/Llama-2-7b-hf"), find_gpu(gpu), seq_len=512)
    assert p.setup.technique == technique
    # the planner's fit test (docs/PLANNER.md): live peak + largest tensor + device-only memory under the budget,
    # and never above the planner's own need for the next batch size
    assert p.estimate.cap_need_bytes <= p.budget_bytes


_MODELS = ["openai-community/gpt2", "meta-llama/Llama-3.2-1B", "google-t5/t5-base", "google-bert/bert-base-uncased",
           "meta-llama/Llama-2-7b-hf"]


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(model=st.sampled_from(_MODELS), mem_gib=st.integers(2, 96), seq=st.sampled_from([128, 512, 1024]),
       prefer=st.sampled_from(["quality", "speed", "memory"]), headroom=st.sampled_from([0.0, 0.05, 0.2]))
def test_chosen_setup_plus_headroom_fits_usable_memory(model, mem_gib, seq, prefer, headroom):
    spec = load_spec(model)
    assume(not spec.arch.max_positions or seq <= spec.arch.max_positions)
    gpu = Gpu(f"{mem_gib} GiB", mem_gib * GiB)
    p = plan(spec, gpu, seq_len=seq, prefer=prefer, headroom=headroom)
    if p.fits:
        used = p.estimate.cap_need_bytes - CUDA_CONTEXT_BYTES  # the planner's fit test (docs/PLANNER.md)
        assert used + p.headroom_bytes <= p.usable_bytes
        assert p.achieved_effective_batch >= 32
    else:
        assert p.smallest.need_bytes > p.budget_bytes and p.suggestions


def test_pins_are_respected():
    pins = dict(technique="lora", lora_r=16, optimizer="adamw-8bit", lora_targets=("q_proj", "v_proj"),
                attn_impl="eager", precision="bf16")
    p = plan(load_spec("meta-llama/Llama-3.2-1B"), find_gpu("RTX 4090"), seq_len=1024, **pins)
    for k, v in pins.items():
        assert getattr(p.setup, k) == v
    p = plan(load_spec("meta-llama/Llama-3.2-1B"), find_gpu("RTX 4090"), batch_size=3)
    assert p.setup.batch_size == 3 and p.setup.grad_accum == 11


def test_lora_pin_implies_an_adapter_technique():
    p = plan(load_spec("openai-community/gpt2"), find_gpu("A100 80GB"), lora_r=32)
    assert p.setup.technique in ("lora", "qlora") and p.setup.lora_r == 32


def test_pinned_rank_keeps_alpha_at_twice_the_rank_and_alternatives_distinct():
    # the rank loop once ran under a pinned rank: the plan wrote lora_alpha 512 for r=16 (alpha of r=256), and
    # its alternatives repeated the choice with other alphas
    p = plan(load_spec("meta-llama/Llama-2-7b-hf"), find_gpu("RTX 4090"), lora_r=16, host_memory="1TiB")
    assert (p.setup.lora_r, p.setup.lora_alpha) == (16, 32)
    assert all((a.setup.lora_r, a.setup.lora_alpha) == (16, 32) for a in p.alternatives)
    assert len({a.setup for a in p.alternatives} | {p.setup}) == len(p.alternatives) + 1


@pytest.mark.parametrize("pins", [{}, {"optimizer": "adafactor"}, {"lora_r": 16, "precision": "bf16"},
                                  {"grad_ckpt": True, "num_gpus": 4}, {"lora_targets": "q_proj,v_proj"},
                                  {"technique": "qlora", "double_quant": False}, {"sharding": "zero3", "num_gpus": 2}])
def test_candidates_are_distinct_and_carry_every_pin(pins):
    from memplan.planner.candidates import candidate_fields
    fields = candidate_fields(True, pins)
    assert len({tuple(sorted((k, repr(v)) for k, v in f.items())) for f in fields}) == len(fields)
    assert all(f[k] == v for f in fields for k, v in pins.items())
    assert all(f["lora_alpha"] == 2 * f["lora_r"] for f in fields if "lora_r" in f and "lora_alpha" not in pins)


def test_contradicting_pins_name_the_rule_they_break():
    from memplan.errors import SetupError
    with pytest.raises(SetupError, match="not supported over ZeRO/FSDP"):
        plan(load_spec("gpt2"), find_gpu("A100 80GB"), num_gpus=2, sharding="zero3", optimizer="adamw-8bit")
    with pytest.raises(SetupError, match="flash_attention_2 runs in fp16/bf16 only"):
        plan(load_spec("gpt2"), find_gpu("A100 80GB"), attn_impl="flash_attention_2", precision="fp32", technique="full")


def test_nothing_fits_names_smallest_setup_and_remedies():
    p = plan(load_spec("meta-llama/Llama-2-70b-hf"), find_gpu("RTX 3060"), num_gpus=1)
    assert not p.fits and p.smallest.setup.technique == "qlora"
    assert any("larger GPU" in t for t in p.suggestions) and any("more GPUs" in t for t in p.suggestions)
    p = plan(load_spec("meta-llama/Llama-2-7b-hf"), Gpu("tiny", 6 * GiB), seq_len=4096, technique="qlora")
    assert not p.fits and any("--seq-len" in t for t in p.suggestions)


def test_bad_preference_and_unknown_pin_are_bad_input():
    from memplan.errors import BadInput
    with pytest.raises(BadInput, match="prefer"):
        plan(load_spec("gpt2"), find_gpu("T4"), prefer="fastest")
    with pytest.raises(BadInput, match="not a Setup field"):
        plan(load_spec("gpt2"), find_gpu("T4"), lora_rank=8)


# --------------------------------------------------------------------------------------------- CLI and plan files

def test_cli_writes_yaml_that_loads_as_real_objects(tmp_path):
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", "meta-llama/Llama-2-7b-hf", "--gpu", "RTX 3060", "--seq-len", "512",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    doc = yaml.safe_load(out.read_text())
    assert doc["model"]["quantization_config"]["load_in_4bit"] is True
    assert doc["training_arguments"]["gradient_accumulation_steps"] * \
        doc["training_arguments"]["per_device_train_batch_size"] >= 32
    import torch
    lp = load_plan(out, output_dir=str(tmp_path / "o"), use_cpu=not torch.cuda.is_available())
    import peft
    import transformers
    assert isinstance(lp.training_arguments, transformers.TrainingArguments)
    assert isinstance(lp.lora_config, peft.LoraConfig) and lp.lora_config.r == lp.setup.lora_r
    assert isinstance(lp.quantization_config, transformers.BitsAndBytesConfig)
    assert lp.quantization_config.bnb_4bit_use_double_quant and lp.prepare_for_kbit_training
    assert lp.training_arguments.per_device_train_batch_size == lp.setup.batch_size


def test_cli_json_and_nothing_fits_exit_1(tmp_path):
    r = CliRunner().invoke(main, ["plan", "meta-llama/Llama-2-70b-hf", "--gpu", "T4", "--num-gpus", "1", "--json",
                                  "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 1
    d = json.loads(r.output)
    assert d["fits"] is False and d["smallest"]["need_bytes"] > d["budget_bytes"] and d["written"] is None
    assert not (tmp_path / "p.json").exists()


def test_cli_bad_input_exit_2():
    r = CliRunner().invoke(main, ["plan", "gpt2", "--gpu", "T4", "--headroom", "150%"])
    assert r.exit_code == 2
    # serving is planned too (test_prequantized.py), but a training knob with it is bad input
    r = CliRunner().invoke(main, ["plan", "gpt2", "--gpu", "T4", "--mode", "infer", "--technique", "lora"])
    assert r.exit_code == 2, r.output


def test_load_plan_refuses_overriding_a_planned_memory_knob(tmp_path):
    from memplan.errors import BadInput
    out = tmp_path / "p.json"
    assert CliRunner().invoke(main, ["plan", "gpt2", "--memory", "8GiB", "-o", str(out)]).exit_code == 0
    with pytest.raises(BadInput, match="per_device_train_batch_size"):
        load_plan(out, per_device_train_batch_size=64)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {}\n")
    with pytest.raises(BadInput, match="not a memplan plan file"):
        load_plan(bad)


def _example():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[2] / "examples" / "train_with_plan.py"
    spec = importlib.util.spec_from_file_location("train_with_plan", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("model,pins", [
    ("openai-community/gpt2", ["--technique", "lora", "--lora-r", "8"]),
    ("google-t5/t5-small", ["--technique", "freeze", "--target-len", "16"]),
])
def test_two_trainer_steps_from_a_plan_on_cpu(tmp_path, model, pins):
    """The example script trains from a plan file (random init, synthetic full-length samples) on the CPU."""
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", model, "--memory", "2GiB", "--seq-len", "32", "--effective-batch", "4",
                                  "--precision", "fp32", "--optimizer", "adamw-fused", "-o", str(out), *pins])
    assert r.exit_code == 0, r.output
    result = _example().main([str(out), "--synthetic", "8", "--random-init", "--max-steps", "2",
                              "--output-dir", str(tmp_path / "run")])
    assert result.global_step == 2 and result.training_loss > 0


@pytest.mark.slow
@pytest.mark.parametrize("trainer,pins", [
    ("sft", ["--seq-len", "32", "--packing"]),
    ("dpo", ["--seq-len", "32", "--prompt-len", "16"]),
    ("grpo", ["--seq-len", "16", "--num-generations", "2", "--max-completion-length", "8"]),
])
def test_two_trl_steps_from_a_plan_on_cpu(tmp_path, monkeypatch, trainer, pins):
    """examples/train_trl_with_plan.py trains two steps of the planned TRL trainer (random init, synthetic rows and a
    word-level tokenizer: no Hub), with the plan's TRL config (load_plan builds SFTConfig / DPOConfig / GRPOConfig)."""
    import importlib.util
    import sys
    from pathlib import Path
    pytest.importorskip("trl")
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", "HuggingFaceTB/SmolLM2-135M", "--memory", "4GiB", "--effective-batch", "4",
                                  "--precision", "fp32", "--optimizer", "adamw-fused", "--technique", "lora",
                                  "--trainer", trainer, "-o", str(out), *pins])
    assert r.exit_code == 0, r.output
    plan = load_plan(out, output_dir=str(tmp_path / "run"))
    assert type(plan.training_arguments).__name__ == {"sft": "SFTConfig", "dpo": "DPOConfig",
                                                      "grpo": "GRPOConfig"}[trainer]
    examples = Path(__file__).parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    spec = importlib.util.spec_from_file_location("train_trl_with_plan", examples / "train_trl_with_plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main([str(out), "--synthetic", "8", "--random-init", "--max-steps", "2",
                       "--output-dir", str(tmp_path / "run")])
    assert result.global_step == 2
    sys.modules.pop("train_with_plan", None)


#: Planned batches that ran out of memory on an H200 capped to each card (data/measured/planner-check.csv,
#: 2026-11-27) before the need held the split cache of checkpointed steps, and the largest batch measured to fit.
RAN_OUT = [
    ("meta-llama/Llama-2-7b-hf", "RTX 3060", dict(technique="qlora", precision="bf16", seq_len=512), 12, 11),
    ("Qwen/Qwen2.5-0.5B", "RTX 3060", dict(trainer="dpo", technique="lora", precision="bf16-mixed", seq_len=1024),
     24, None),
    ("meta-llama/Llama-3.2-1B", "A10", dict(trainer="dpo", technique="full", precision="bf16", seq_len=1024), 29, 28),
    ("Qwen/Qwen2.5-0.5B", "RTX 4060 Ti 16GB", dict(trainer="grpo", technique="lora", precision="bf16-mixed",
                                                   seq_len=256, max_completion_length=256, num_generations=4),
     140, None),
]


@pytest.mark.parametrize("model,card,pins,oom,fitted", RAN_OUT, ids=[f"{m}-{c}" for m, c, *_ in RAN_OUT])
def test_checkpointed_plans_stay_below_the_batches_that_ran_out(model, card, pins, oom, fitted):
    """The closed form's need holds CAP_FRAGMENTATION_CKPT of the activations with checkpointing: the planned
    micro-batch is below the one that ran out of memory and, where the largest fitting batch was measured, within
    90% of it (the planner check's bar)."""
    p = plan(model, card, effective_batch=512, replay=False, attn_impl="sdpa", grad_accum=1, grad_ckpt=True, **pins)
    e = p.estimate
    assert e.cap_fragmentation_bytes == int(0.10 * e.components["activations"]) > 0
    assert e.allocator_need_bytes == e.peak_allocated_bytes + e.largest_block_bytes + e.cap_fragmentation_bytes
    assert p.setup.batch_size < oom
    if fitted:
        assert p.setup.batch_size >= 0.9 * fitted


def test_the_split_cache_needs_checkpointing():
    """Without checkpointing the need is the live peak plus the largest tensor (every such planner run that ran
    out of memory had under 0.1% of the usable memory spare: docs/PLANNER.md "Budget")."""
    from memplan.estimator.breakdown import estimate
    e = estimate("meta-llama/Llama-3.2-1B", technique="lora", batch_size=2, seq_len=512)
    assert e.cap_fragmentation_bytes == 0
    assert e.allocator_need_bytes == e.peak_allocated_bytes + e.largest_block_bytes


def test_the_default_says_what_tracing_the_replay_costs(monkeypatch, tmp_path):
    # an empty replay cache: the default plans with the closed form and says what `--replay` would cost;
    # GRPO's generate() is traced (memplan.replay.decode: runs of 8, 9 and 12 tokens)
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path))
    grpo = plan("Qwen/Qwen2.5-0.5B", "RTX 4060 Ti 16GB", trainer="grpo", technique="lora", seq_len=256,
                max_completion_length=256, num_generations=4, grad_accum=1, effective_batch=512, grad_ckpt=True)
    assert grpo.setup.batch_size > 16  # past one pass of TRL's head: traced per micro-batch
    assert "a few minutes" in grpo.replay["closed_form"] and "4,096 tokens" in grpo.replay["closed_form"]
    sft = plan("Qwen/Qwen2.5-0.5B", "RTX 4060 Ti 16GB", technique="lora", seq_len=256)
    assert "seconds to a minute" in sft.replay["closed_form"]
