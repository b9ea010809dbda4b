"""fit(): max micro-batch search against a fake estimator (probe order) and option rows."""
from __future__ import annotations

from dataclasses import dataclass

from memplan.planner.fit_table import fit, max_batch_size
from memplan.gpus import Gpu
from memplan.model.catalog import load_spec
from memplan.setup import Setup


@dataclass
class _Fake:
    cap_need_bytes: int  # what memplan.planner.budget.need_bytes reads


def _recorder(per_sample: int, fixed: int = 0):
    calls = []

    def estimator(spec, setup):
        calls.append(setup.batch_size)
        return _Fake(fixed + per_sample * setup.batch_size)

    return estimator, calls


def test_doubling_then_bisection_probe_order():
    est, calls = _recorder(per_sample=10)
    assert max_batch_size(None, Setup(), budget_bytes=100, estimator=est) == 10
    assert calls == [1, 2, 4, 8, 16, 12, 10, 11]


def test_nothing_fits_and_limit():
    est, calls = _recorder(per_sample=10, fixed=1000)
    assert max_batch_size(None, Setup(), 100, est) == 0 and calls == [1]
    est, calls = _recorder(per_sample=1)
    assert max_batch_size(None, Setup(), 10**9, est, limit=64) == 64


def test_fit_rows_agree_with_the_real_estimator():
    """Each row's largest batch is the last whose need (live peak + largest tensor + memory outside the allocator)
    is within the budget: the GPU memory less 3.5% of what the CUDA context leaves."""
    import dataclasses

    from memplan.estimator.breakdown import estimate
    from memplan.estimator.memory.overhead import CUDA_CONTEXT_BYTES
    spec = load_spec("gpt2")
    gpu = Gpu(name="test 8 GiB", memory_bytes=8 * 2**30)
    result = fit(spec, gpu, seq_len=256)
    budget = gpu.memory_bytes - int(0.035 * (gpu.memory_bytes - CUDA_CONTEXT_BYTES))
    assert result.budget_bytes == budget and any(r.fits for r in result.rows)
    for row in result.rows:
        if row.fits:
            at = estimate(spec, dataclasses.replace(row.setup, batch_size=row.max_batch_size))
            over = estimate(spec, dataclasses.replace(row.setup, batch_size=row.max_batch_size + 1))
            assert at.cap_need_bytes <= budget < over.cap_need_bytes
            assert row.need_bytes_at_batch_1 == estimate(spec, row.setup).cap_need_bytes


def test_fit_plan_and_doctor_share_one_fit_test():
    """The planner's micro-batch for a pinned setup, fit's row and doctor's verdict agree (memplan.planner.budget)."""
    import dataclasses

    from memplan.planner.doctor import diagnose
    from memplan.estimator.breakdown import estimate
    from memplan.planner.budget import budget_bytes
    from memplan.planner.search import plan
    spec = load_spec("gpt2")
    gpu = Gpu(name="test 6 GiB", memory_bytes=6 * 2**30)
    row = next(r for r in fit(spec, gpu, seq_len=512).rows if r.option.startswith("LoRA"))
    b = row.max_batch_size
    pins = {k: getattr(row.setup, k) for k in ("technique", "precision", "optimizer", "lora_r", "grad_ckpt")}
    pins.update(lora_targets=row.setup.lora_targets or None, attn_impl=row.setup.attn_impl, grad_accum=1)
    assert b > 1 and plan(spec, gpu, seq_len=512, effective_batch=b, batch_size=b, **pins).fits
    assert not plan(spec, gpu, seq_len=512, effective_batch=b + 1, batch_size=b + 1, **pins).fits
    budget = budget_bytes(gpu.memory_bytes)
    at = dataclasses.replace(row.setup, batch_size=row.max_batch_size)
    assert diagnose(spec, at, budget).fits
    assert not diagnose(spec, dataclasses.replace(at, batch_size=at.batch_size + 1), budget).fits
    assert estimate(spec, at).cap_need_bytes <= budget


def test_inference_rows_respect_max_positions():
    rows = fit(load_spec("gpt2"), Gpu(name="x", memory_bytes=80 * 2**30), seq_len=1000).rows
    infer = [r for r in rows if r.setup.mode == "infer"]
    assert all(r.setup.prompt_len + r.setup.new_tokens <= 1024 and not r.error for r in infer)


def test_lora_rows_fall_back_to_all_linear_where_peft_has_no_default_targets():
    """peft has no default LoRA targets for Phi-3 (LoraConfig raises without target_modules): fit shows the
    all-linear rows, labelled, instead of 'n/a'."""
    from memplan.planner.fit_table import option_setups
    from memplan.gpus import resolve_gpu
    from memplan.model.catalog import load_spec

    rows = dict(option_setups(load_spec("microsoft/Phi-3-mini-4k-instruct"), resolve_gpu("rtx-4090"), 512))
    lora = {name: s for name, s in rows.items() if s.technique in ("lora", "qlora")}
    assert lora and all(s.lora_targets == "all-linear" and name.endswith("(all-linear)") for name, s in lora.items())
    gpt2 = dict(option_setups(load_spec("gpt2"), resolve_gpu("rtx-4090"), 512))
    assert all(s.lora_targets is None for s in gpt2.values())
