"""Trace one rank of FSDP training without a GPU or a cluster: the real torch FSDP2 (`fully_shard`) over a fake
process group, on fake tensors - the ground truth the multi-GPU estimate (memory/distributed.py) is tested against.

How (torchtitan estimated FSDP memory the same way): `dist.init_process_group("fake", world_size=N)` makes this
process rank 0 of N; the fake backend's collectives move no data, but FSDP2 allocates its own all-gather and
reduce-scatter buffers at their real sizes, so every storage the rank holds is there. The model is memplan's traced
model (memplan.steps.build_model: dtype, LoRA, checkpointing), each transformer block (the model's
`_no_split_modules`, what accelerate's TRANSFORMER_BASED_WRAP wraps) and then the root get `fully_shard` with
accelerate's bf16 policy (param_dtype = reduce_dtype = the compute dtype), and the step runs under
memplan.trace's storage tracker, which here also sees FSDP2's `storage.resize_` (how it frees and re-allocates
unsharded parameters) and counts a DTensor by its local shard.

Not traced: the CUDA streams' overlap (on the CPU the next unit's all-gather is issued but not run ahead, so one
unit of prefetch the GPU may hold can be missing), NCCL's own buffers, DeepSpeed (it needs its accelerator), FSDP1,
CPU offload and quantized bases.
"""
from __future__ import annotations

import contextlib

from memplan.errors import BadInput
from memplan.setup import FSDP_SHARDINGS, Setup
from memplan.trace import StorageTracker, TraceResult, _extrapolate, _result, _round, _run


class ShardedTracker(StorageTracker):
    """StorageTracker that counts DTensors by their local shard and follows storage resizes."""

    def serial_of(self, t):
        local = getattr(t, "_local_tensor", None)  # DTensor (sharded parameters, optimizer state)
        return super().serial_of(local if local is not None else t)

    def resized(self, storage) -> None:
        key = storage._cdata
        hit = self.live.get(key)
        if hit is None:
            return
        serial, old = hit
        new = _round(storage.nbytes())
        self.live[key] = (serial, new)
        if serial not in self.excluded:
            self.current += new - old
            self._update()


@contextlib.contextmanager
def follow_resizes(tracker: ShardedTracker):
    """FSDP2 frees an unsharded parameter by resizing its storage to 0 and re-allocates it by resizing back; the
    dispatcher never sees those, so storage.resize_ reports them to the tracker while the run lasts."""
    import torch
    original = torch.UntypedStorage.resize_

    def resize_(self, n):
        out = original(self, n)
        tracker.resized(self)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """This process as rank 0 of `world_size` on torch's fake backend, and a CPU device mesh over it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise BadInput("a torch.distributed process group is already initialised in this process")
    dist.init_process_group(backend="fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside fake mode: the mesh reads real tensors
    finally:
        dist.destroy_process_group()


def _blocks(model) -> list:
    """The modules accelerate's TRANSFORMER_BASED_WRAP wraps: instances of the model's _no_split_modules classes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _sharder(setup: Setup, mesh, tracker: ShardedTracker):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[setup.compute_dtype]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)

    def shard(model):
        blocks = _blocks(model)
        if not blocks:
            raise BadInput(f"{type(model).__name__} names no _no_split_modules: no transformer blocks to shard")
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=setup.sharding == "fsdp-full-shard")
        fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: not resharded after forward (FSDP2 default)
        return follow_resizes(tracker)

    return shard


def trace_sharded(model, setup: Setup, layers: int | None = None, steps: int = 2) -> TraceResult:
    """Trace rank 0 of an FSDP setup (sharding fsdp-full-shard or fsdp-shard-grad-op, no offload, no quantization)
    on fake tensors. layers: trace N and N+1 blocks and extrapolate to the full depth (as memplan.trace)."""
    from memplan.memory.context import resolve
    from memplan.models import config_dict, load_spec
    from memplan.steps import cut_config

    spec = load_spec(model)
    problems = []
    if setup.sharding not in FSDP_SHARDINGS:
        problems.append(f"trace_sharded traces FSDP (--sharding {' or '.join(FSDP_SHARDINGS)}), not {setup.sharding}")
    if setup.offload != "none" or setup.quant:
        problems.append("CPU offload and quantized bases are not traced")
    if setup.mode != "train" or steps < 2:
        problems.append("trace runs at least 2 training steps")
    if problems:
        raise BadInput("; ".join(problems))
    resolve(spec, setup)
    d = config_dict(spec)
    total = max(spec.arch.num_encoder_layers, spec.arch.num_decoder_layers)

    def run(n: int | None):
        tracker = ShardedTracker()
        with fake_process_group(setup.world_size) as mesh:
            return _run(spec, setup, cut_config(d, n) if n else d, n, steps, True, tracker=tracker,
                        shard=_sharder(setup, mesh, tracker))

    if not layers or layers >= total:
        return _result(spec, setup, run(None), None, total)
    return _extrapolate(spec, setup, run(layers), run(layers + 1), layers, total)
