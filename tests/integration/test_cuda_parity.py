"""The tracer's CUDA emulations against torch's own CUDA code paths, without a GPU: CUDA autocast
(memplan.runtime.emulate.autocast), dropout, and the optimizers' steps.

torch registers the AutocastCUDA kernels in CPU-only builds too, and fake CUDA tensors reach them once CUDA autocast
is switched on directly (torch.set_autocast_enabled("cuda", True); torch.autocast("cuda") refuses without a GPU).
Each case runs twice on fake tensors: on "cpu" under CPU autocast and the tracer's emulations
(memplan.runtime.emulate.cuda.cuda_like), and on "cuda" under CUDA autocast (what the GPU does); the aten ops each
dispatches, with their input and output dtypes, must be the same. No autograd: it needs a CUDA device guard, which a CPU-only build aborts on (not raises), so
the probe runs in a subprocess.

The optimizers (memplan.runtime.steps.make_optimizer: what Trainer builds) take three steps over fake parameters with
gradients set by hand, on "cpu" as the tracer runs them and on "cuda", where torch.optim picks its CUDA branches
(foreach/fused grouping, step tensors on the device); every storage they allocate is recorded.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cases():
    import torch
    import torch.nn.functional as F

    def t(dev, *shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device=dev, dtype=dtype)

    f32 = torch.float32
    return {
        "linear": lambda d: F.linear(t(d, 4, 8, dtype=f32), t(d, 8, 8, dtype=f32)),
        "matmul": lambda d: t(d, 2, 4, 8, dtype=f32) @ t(d, 8, 8, dtype=f32),
        "bmm": lambda d: torch.bmm(t(d, 2, 4, 8, dtype=f32), t(d, 2, 8, 4, dtype=f32)),
        "einsum": lambda d: torch.einsum("ij,jk->ik", t(d, 4, 8, dtype=f32), t(d, 8, 8, dtype=f32)),
        "mv": lambda d: torch.mv(t(d, 8, 8, dtype=f32), t(d, 8, dtype=f32)),
        "pow": lambda d: (torch.pow(t(d, 4, 8), 3.0), t(d, 4, 8) ** 2, 2 ** t(d, 4, 8)),
        "exp/log/rsqrt": lambda d: (torch.exp(t(d, 8)), torch.log(t(d, 8)), torch.rsqrt(t(d, 8))),
        "layer_norm": lambda d: F.layer_norm(t(d, 4, 8), (8,), t(d, 8, dtype=f32), t(d, 8, dtype=f32)),
        "softmax": lambda d: (F.softmax(t(d, 4, 8), -1), F.log_softmax(t(d, 4, 8), -1), t(d, 4, 8).softmax(-1)),
        "sum/cumsum/prod": lambda d: (t(d, 4, 8).sum(), t(d, 4, 8).sum(-1), torch.cumsum(t(d, 4, 8), 0),
                                      torch.prod(t(d, 4, 8))),
        "norms": lambda d: (t(d, 4, 8).norm(), torch.linalg.vector_norm(t(d, 4, 8))),
        "logsumexp": lambda d: torch.logsumexp(t(d, 4, 8), -1),
        "cat/stack (partial rotary)": lambda d: (torch.cat((t(d, 4, 8, dtype=f32), t(d, 4, 8)), -1),
                                                 torch.stack((t(d, 4, 8, dtype=f32), t(d, 4, 8)))),
        "promote": lambda d: (torch.addcmul(t(d, 4, 8, dtype=f32), t(d, 4, 8), t(d, 4, 8, dtype=f32)),
                              torch.atan2(t(d, 8), t(d, 8, dtype=f32))),
        "losses": lambda d: (F.mse_loss(t(d, 4, 8), t(d, 4, 8)),
                             F.nll_loss(t(d, 4, 8), torch.zeros(4, dtype=torch.long, device=d)),
                             F.cross_entropy(t(d, 4, 8), torch.zeros(4, dtype=torch.long, device=d))),
        "unlisted": lambda d: (F.gelu(t(d, 4, 8), approximate="tanh"), F.silu(t(d, 4, 8)), t(d, 4, 8) * 2.0,
                               t(d, 4, 8) + t(d, 4, 8, dtype=f32)),
        "cosine_similarity": lambda d: F.cosine_similarity(t(d, 4, 8), t(d, 4, 8)),
        "dropout": lambda d: (F.dropout(t(d, 4, 8), 0.1, True), torch.nn.Dropout(0.1)(t(d, 4, 8, dtype=f32))),
    }


def _probe() -> dict:
    """{case: {"cpu": ops, "cuda": ops}}: each op as [name, input dtypes, output dtypes]."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from memplan.runtime.emulate.autocast import autocast_switched_on
    from memplan.runtime.emulate.cuda import cuda_like

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not str(func).startswith("prim."):
                dt = lambda xs: [str(x.dtype) for x in tree_flatten(xs)[0] if isinstance(x, torch.Tensor)]  # noqa
                self.ops.append([str(func), dt((args, kwargs)), dt(out)])
            return out

    def run(dev, fn):
        log = Log()
        with FakeTensorMode(allow_non_fake_inputs=True), autocast_switched_on(dev, torch.bfloat16), \
                (cuda_like() if dev == "cpu" else contextlib.nullcontext()):
            fn(dev, log)
        return log.ops

    out = {"optimizers": {opt: {dev: _optimizer_allocations(dev, opt) for dev in ("cpu", "cuda")}
                          for opt in OPTIMIZERS}}
    for name, case in _cases().items():
        def fn(dev, log, case=case):
            # inputs are made before logging: run the case's factories, then replay the call under the log
            with log:
                case(dev)
        out[name] = {dev: [op for op in run(dev, fn) if not op[0].startswith(("aten.empty", "aten.zeros"))]
                     for dev in ("cpu", "cuda")}
    return out


OPTIMIZERS = ("adamw", "adamw-fused", "sgd", "adafactor")
PARAM_SHAPES = ((1024, 768), (768,), (3072, 768), (50, 7))


def _optimizer_allocations(dev: str, optimizer: str) -> dict:
    """Per step: the peak live bytes and the sizes of the storages allocated, over three optimizer steps."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.setup import Setup
    from memplan.runtime.steps import make_optimizer
    from memplan.runtime.tracker import StorageTracker, dispatch_mode, round_block

    class OnDevice(StorageTracker):  # GPU memory only: Adafactor's torch.zeros(...).to(grad) makes a CPU temporary
        def serial_of(self, t):
            return super().serial_of(t) if isinstance(t, torch.Tensor) and t.device.type == dev else None

    tracker = OnDevice(events=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.nn.Parameter(torch.empty(shape, device=dev)) for shape in PARAM_SHAPES]
        opt = make_optimizer(Setup(optimizer=optimizer), params)
        with dispatch_mode(tracker):
            for step in range(3):
                tracker.phase = f"step {step}"
                for p in params:
                    p.grad = torch.empty(p.shape, device=dev)
                opt.step()
                tracker.phase = "between"
                for p in params:
                    p.grad = None
    sizes: dict[str, list[int]] = {}
    for _, n, phase in tracker.events:
        if n and phase != "between":  # events hold a storage's own bytes; the allocator hands out 512 B blocks
            sizes.setdefault(phase, []).append(round_block(n))
    return {"peaks": dict(tracker.phase_peaks), "sizes": {k: sorted(v) for k, v in sizes.items()}}


@pytest.fixture(scope="module")
def probed():
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip(f"AutocastCUDA kernels cannot run on fake CUDA tensors with this torch: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(_cases()))
def test_emulated_cpu_autocast_dispatches_as_cuda_autocast(probed, case):
    got = probed[case]
    assert got["cuda"], f"{case}: nothing dispatched on the CUDA side"
    assert got["cpu"] == got["cuda"], f"{case}:\n cpu  {got['cpu']}\n cuda {got['cuda']}"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_steps_allocate_as_on_cuda(probed, optimizer):
    """The same device storages and peaks as the CUDA code path, step by step, but for torch.optim's scalar step
    counters: foreach AdamW keeps `state["step"]` (one per parameter) and its increment on the host when the
    parameters are on CUDA, on the device when they are on the CPU - the tracer counts those 512 B blocks (150 KB for
    a 7B model's ~300 parameters), the GPU does not."""
    cpu, cuda = probed["optimizers"][optimizer]["cpu"], probed["optimizers"][optimizer]["cuda"]
    assert cuda["sizes"], f"{optimizer}: nothing allocated on the CUDA side"
    scalars = 0
    for step, sizes in cpu["sizes"].items():
        extra = list(sizes)
        for n in cuda["sizes"][step]:
            extra.remove(n)  # ValueError: CUDA allocates a storage the tracer's path does not
        assert set(extra) <= {512} and len(extra) <= len(PARAM_SHAPES) + 1, f"{optimizer} {step}: the tracer's path also makes {extra}"
        scalars = max(scalars, len(extra))
    for step, peak in cpu["peaks"].items():
        assert 0 <= peak - cuda["peaks"][step] <= 512 * scalars


def test_the_unemulated_cpu_policy_differs(probed):
    """The check can fail: without the emulation, CPU autocast leaves pow in bf16 and copies cat's bf16 input."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.empty(4, 8, dtype=torch.bfloat16)
        assert torch.pow(h, 3.0).dtype == torch.bfloat16
    pow_cuda = [op for op in probed["pow"]["cuda"] if op[0].startswith("aten.pow")]
    assert pow_cuda and all(op[2] == ["torch.float32"] for op in pow_cuda)


if __name__ == "__main__":
    print(json.dumps(_probe()))
