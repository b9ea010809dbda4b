"""fit(): max micro-batch search against a fake estimator (probe order) and option rows."""
from __future__ import annotations

from dataclasses import dataclass

from memplan.fit import fit, max_batch_size
from memplan.gpus import Gpu
from memplan.models import load_spec
from memplan.setup import Setup


@dataclass
class _Fake:
    device_total_bytes: int


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
    from memplan.estimate import estimate
    spec = load_spec("gpt2")
    gpu = Gpu(name="test 8 GiB", memory_bytes=8 * 2**30)
    result = fit(spec, gpu, seq_len=256)
    for row in result.rows:
        if row.fits:
            import dataclasses
            at = estimate(spec, dataclasses.replace(row.setup, batch_size=row.max_batch_size))
            over = estimate(spec, dataclasses.replace(row.setup, batch_size=row.max_batch_size + 1))
            assert at.device_total_bytes <= gpu.memory_bytes < over.device_total_bytes


def test_inference_rows_respect_max_positions():
    rows = fit(load_spec("gpt2"), Gpu(name="x", memory_bytes=80 * 2**30), seq_len=1000).rows
    infer = [r for r in rows if r.setup.mode == "infer"]
    assert all(r.setup.prompt_len + r.setup.new_tokens <= 1024 and not r.error for r in infer)
