"""Trace one rank of FSDP training without a GPU or a cluster: the real torch FSDP2 (`fully_shard`) over a fake
process group, on fake tensors - the ground truth the multi-GPU estimate (memory/distributed.py) is tested against.

How (torchtitan estimated FSDP memory the same way): `dist.init_process_group("fake", world_size=N)` makes this
process rank 0 of N; the fake backend's collectives move no data, but FSDP2 allocates its own all-gather and
reduce-scatter buffers at their real sizes, so every storage the rank holds is there. The model is memplan's traced
model (memplan.runtime.steps.build_model: dtype, LoRA, checkpointing), each transformer block (the model's
`_no_split_modules`, what accelerate's TRANSFORMER_BASED_WRAP wraps) and then the root get `fully_shard` with
accelerate's bf16 policy (param_dtype = reduce_dtype = the compute dtype), and the step runs under
memplan.tracer.training's storage tracker, which here also sees FSDP2's `storage.resize_` (how it frees and re-allocates
unsharded parameters) and counts a DTensor by its local shard.

DeepSpeed ZeRO-1/2/3 (trace_deepspeed) runs the same way on DeepSpeed's CPU accelerator: the fake group is
initialised first, so deepspeed.comm wraps it ("the user initialized torch.dist themselves"), and
deepspeed.initialize builds the real ZeRO optimizer around the Trainer's torch AdamW. ZeRO reads and copies real
storages, so those tensors are real and small (the model cut to a few blocks); bf16 matmuls, which this kind of CPU
runs very slowly, are computed in fp32 and cast back inside the dispatch mode (the tracked output has its true
size). Every live byte was checked against the tensors reachable through gc at quiet points (equal to the byte).

Not traced: the CUDA streams' overlap (on the CPU the next unit's all-gather is issued but not run ahead, so one
unit of prefetch the GPU may hold can be missing), NCCL's own buffers, FSDP1, CPU offload and quantized bases.
"""
from __future__ import annotations

import contextlib

from memplan.errors import BadInput
from memplan.setup import FSDP_SHARDINGS, Setup
from memplan.tracer.training import TraceResult, extrapolate, result_from, run_traced
from memplan.runtime.tracker import StorageTracker, dispatch_mode, round_block
from memplan.estimator.launch import deepspeed_config
from memplan.model.catalog import config_dict, load_spec
from memplan.model.compat import check_setup
from memplan.runtime.steps import cut_config, build_model, make_batch, make_optimizer, materialize


class ShardedTracker(StorageTracker):
    """StorageTracker that counts DTensors by their local shard and follows storage resizes."""

    def serial_of(self, t):
        local = getattr(t, "_local_tensor", None)  # DTensor (sharded parameters, optimizer state)
        t = local if local is not None else t
        if getattr(t, "is_meta", False):  # meta copies (ZeRO's round-robin bookkeeping) hold no memory
            return None
        return super().serial_of(t)

    def resized(self, storage) -> None:
        key = storage._cdata
        hit = self.live.get(key)
        if hit is None:
            return
        serial, old = hit
        new = round_block(storage.nbytes())
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
    on fake tensors. layers: trace N and N+1 blocks and extrapolate to the full depth (as memplan.tracer.training)."""

    spec = load_spec(model)
    problems = []
    if setup.sharding not in FSDP_SHARDINGS:
        problems.append(f"trace_sharded traces FSDP (--sharding {' or '.join(FSDP_SHARDINGS)}), not {setup.sharding}"
                        + ("; DDP ranks run the single-GPU step plus gradient buckets: trace without --sharding"
                           if setup.sharding == "ddp" else ""))
    if setup.offload != "none" or setup.quant:
        problems.append("CPU offload and quantized bases are not traced")
    if setup.mode != "train" or steps < 2:
        problems.append("trace runs at least 2 training steps")
    if problems:
        raise BadInput("; ".join(problems))
    check_setup(spec, setup)
    d = config_dict(spec)
    total = max(spec.arch.num_encoder_layers, spec.arch.num_decoder_layers)

    def sharded_run(n: int | None):
        tracker = ShardedTracker()
        with fake_process_group(setup.world_size) as mesh:
            return run_traced(spec, setup, cut_config(d, n) if n else d, n, steps, True, tracker=tracker,
                               shard=_sharder(setup, mesh, tracker))

    layers = _fewest_blocks(layers)
    if not layers or layers >= total:
        return result_from(spec, setup, sharded_run(None), None, total)
    return extrapolate(spec, setup, sharded_run(layers), sharded_run(layers + 1), layers, total)


#: the fewest blocks a sharded trace extrapolates from. With 2, the first block is also the penultimate and the second
#: the last, and FSDP treats its edge blocks apart (the backward prefetches the next block's all-gather, the root's
#: parameters stay gathered from forward to backward): the per-block difference between 2 and 3 blocks is not one
#: middle block's (evidence: docs/MODEL.md, memplan/tracer/sharded.py).
MIN_SHARDED_BLOCKS = 3


def _fewest_blocks(layers: int | None) -> int | None:
    return max(layers, MIN_SHARDED_BLOCKS) if layers else layers


# ---------------------------------------------------------------------------------------------------- DeepSpeed

def _fp32_matmul_mode(tracker: StorageTracker):
    """The tracker's dispatch mode, computing bf16 matmuls in fp32 (untracked inputs' copies, output cast back)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten.baddbmm.default}

    def up(a):
        return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a

    def compute(func, args, kwargs):
        if func in mm and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in tree_flatten(args)[0]):
            return func(*tree_map(up, args), **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)

    return dispatch_mode(tracker, compute)


@contextlib.contextmanager
def _rank_environment(world_size: int):
    """The launcher variables DeepSpeed reads (RANK, LOCAL_RANK, WORLD_SIZE; DS_ACCELERATOR=cpu unless set), put
    back as they were afterwards (Trainer/accelerate read them too)."""
    import os
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR")
    before = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size),
                      DS_ACCELERATOR=before["DS_ACCELERATOR"] or "cpu")
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _deepspeed():
    """deepspeed on its CPU accelerator over an initialised fake group, without JIT-building its shm op."""
    import sys
    try:
        import deepspeed
    except ImportError:
        raise BadInput("tracing ZeRO needs deepspeed: pip install deepspeed") from None
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel("WARNING")
    return deepspeed


@contextlib.contextmanager
def _fresh_deepspeed_groups():
    """DeepSpeed caches its communication backend and process groups in module globals; a traced run must not see
    the (destroyed) groups of the previous one: the globals are put back to their values at entry afterwards."""
    import copy

    from deepspeed.comm import comm
    from deepspeed.utils import groups
    saved = {k: copy.copy(v) for k, v in vars(groups).items() if k.startswith("_") and k[1:2].isupper()}
    try:
        yield
    finally:
        vars(groups).update(saved)
        comm.cdb = None


def _run_deepspeed(spec, setup: Setup, d: dict, layers: int | None, steps: int) -> StorageTracker:
    import torch

    tracker = ShardedTracker()
    model = build_model(spec, setup, layers, d)
    with fake_process_group(setup.world_size), _rank_environment(setup.world_size):
        deepspeed = _deepspeed()
        config = {**deepspeed_config(spec, setup), "zero_allow_untested_optimizer": True}
        with _fresh_deepspeed_groups(), _fp32_matmul_mode(tracker), follow_resizes(tracker):
            torch.manual_seed(0)
            materialize(model, fake=False)
            params = [p for p in model.parameters() if p.requires_grad]
            engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(setup, params), config=config)
            vocab = model.get_input_embeddings().num_embeddings
            for _ in range(steps):
                batch = make_batch(spec, setup, vocab, "cpu")
                tracker.phase = "forward"
                loss = engine(**batch).loss
                tracker.phase = "backward"
                engine.backward(loss)
                del loss, batch
                tracker.phase = "optimizer"
                engine.step()
                tracker.phase = "between"
            tracker.trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params)
            tracker.total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            engine.destroy()
    return tracker


def trace_deepspeed(model, setup: Setup, layers: int | None = None, steps: int = 2) -> TraceResult:
    """Trace rank 0 of a DeepSpeed ZeRO setup (sharding zero1/2/3, bf16/fp16/fp32, no offload, no quantization) on
    real CPU tensors; layers: trace N and N+1 blocks and extrapolate to the full depth.

    Runs in a fresh child process: DeepSpeed patches torch and keeps global state once initialised (later traces
    in the same process would see its hooks)."""
    import concurrent.futures
    import multiprocessing

    model = getattr(model, "model_id", model)  # a ModelSpec: its catalog id or config path loads it again
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_trace_deepspeed_here, str(model), setup, layers, steps).result()


def _trace_deepspeed_here(model, setup: Setup, layers: int | None, steps: int) -> TraceResult:
    spec = load_spec(model)
    if setup.engine != "deepspeed" or setup.offload != "none" or setup.quant or setup.mode != "train" or steps < 2:
        raise BadInput("trace_deepspeed traces ZeRO-1/2/3 training (no offload, no quantized base, >= 2 steps)")
    check_setup(spec, setup)
    d = config_dict(spec)
    total = max(spec.arch.num_encoder_layers, spec.arch.num_decoder_layers)
    layers = _fewest_blocks(layers)
    if not layers or layers >= total:
        return result_from(spec, setup, _run_deepspeed(spec, setup, d, None, steps), None, total)
    a = _run_deepspeed(spec, setup, cut_config(d, layers), layers, steps)
    b = _run_deepspeed(spec, setup, cut_config(d, layers + 1), layers + 1, steps)
    return extrapolate(spec, setup, a, b, layers, total)
