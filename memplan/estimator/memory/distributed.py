"""Per-GPU model state under data parallelism: DDP replicas, DeepSpeed ZeRO-1/2/3, PyTorch FSDP, CPU offload.

Every rank runs its own micro-batch, so activations, logits and backward temporaries are the single-GPU ones
(computed by the caller, with the precision the engine really computes in: `compute_setup`). What changes per rank
is where the model states live (ZeRO paper, Rajbhandari et al., arXiv:1910.02054, sec. 5.1 and Fig. 1: with N ranks,
mixed-precision Adam keeps 2 B fp16 params + 2 B fp16 grads + 12 B fp32 master/momentum/variance per parameter;
P_os divides the 12 B by N, P_os+g also the grads, P_os+g+p also the params) and which buffers the engine adds.
Unlike DeepSpeed's own estimators (deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs,
stage3.py estimate_zero3_model_states_mem_needs), which count every parameter as trainable and nothing beyond model
states, frozen parameters here carry no gradients or optimizer state (LoRA, freezing: DeepSpeed issue #5304) and
activations, gathered units and communication buckets are counted.

Engines and what they keep per rank (N = world size, Psi = parameters, t = trainable):
  ddp    torch DistributedDataParallel: full replica (the single-GPU states) + gradient buckets of the gradients'
         total size (torch/nn/parallel/distributed.py: gradient_as_bucket_view=False, the default, copies grads into
         flat buckets; "the saved memory size will be equal to the total gradients size" when True).
  zero1  16-bit params (full), 16-bit grads (full, reduced at the boundary), fp32 master + optimizer state / N.
  zero2  16-bit params (full), 16-bit grad partition / N + reduce buckets, fp32 master + optimizer state / N.
  zero3  16-bit param partition / N + gathered params of the running module and the prefetch bucket, grad
         partition / N + reduce buckets, fp32 master + optimizer state / N.
  fsdp   sharded params in their stored dtype (fp32 under mixed precision) / N, sharded grads / N, optimizer state
         / N, plus unsharded compute-dtype copies of the running units (a transformer block each, the root unit -
         embeddings, final norm, head - stays unsharded from forward to backward); shard-grad-op keeps every unit
         unsharded between its forward and its backward.
DeepSpeed casts the module to bf16/fp16 when bf16/fp16 is enabled (deepspeed/runtime/engine.py
_configure_distributed_model), so the 16-bit weights above replace the fp32 weights of a mixed-precision setup;
FSDP's MixedPrecision(param_dtype=bf16) likewise makes the blocks compute in 16 bit with no autocast copies.
Offload (DeepSpeed offload_optimizer/offload_param, FSDP CPUOffload(offload_params=True)) moves the fp32 master,
optimizer state and gradient partition (and the param partition) to pinned host memory: `host_bytes` counts them.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from memplan.estimator.memory.context import Ctx, per_model, resolve
from memplan.estimator.memory import optimizer as opt
from memplan.estimator.memory import weights
from memplan.setup import FSDP_SHARDINGS, ZERO_STAGES, Setup
from memplan.units import GiB

#: NCCL's own device buffers (cudaMalloc'd outside PyTorch's allocator, so only in the device total): per channel a
#: FIFO per protocol (NCCL_BUFFSIZE default 4 MiB for Simple, nccl#285), linear in the channel count, up to 32
#: channels per peer pair on NVLink H100s; users report about 1 GiB per GPU for one communicator once a collective
#: ran, excluding PyTorch (nccl#1685 "NV 1.06 GB" before all-to-all; nccl#864). Provisional: not measured by us.
NCCL_DEVICE_BYTES = 1 * GiB
#: DeepSpeed ZeRO-3 optimizer sub-group (zero_optimization.sub_group_size default 1e9 elements, runtime/zero/config.py):
#: the step converts one sub-group's gradients at a time
SUB_GROUP_SIZE = 10 ** 9


def is_distributed(setup: Setup) -> bool:
    return setup.sharding != "none"


def compute_setup(setup: Setup) -> Setup:
    """The setup whose activations a rank computes.

    DeepSpeed (bf16/fp16 enabled) and FSDP (MixedPrecision param_dtype) run the blocks on 16-bit weights: a
    mixed-precision setup computes like its pure 16-bit twin (16-bit hidden stream, no autocast weight copies).
    DDP and the single GPU keep torch.autocast over fp32.
    """
    if setup.engine in ("deepspeed", "fsdp") and setup.mixed:
        return dataclasses.replace(setup, precision=setup.compute_dtype)
    return setup


def compute_ctx(spec, setup: Setup) -> Ctx:
    """The Ctx a rank computes with (compute_setup's).

    Under FSDP accelerate keeps its autocast on over the 16-bit parameters (Ctx.autocast_16bit): softmax,
    log_softmax and nll_loss still run in fp32, so a plain CrossEntropyLoss keeps a bf16 log_softmax, nll_loss's
    fp32 cast and an fp32 gradient, as on one GPU. DeepSpeed casts the module and runs no autocast.
    """
    ctx = resolve(spec, compute_setup(setup))
    if setup.engine == "fsdp" and setup.mixed:
        ctx = dataclasses.replace(ctx, autocast_16bit=True)
    return ctx


# ------------------------------------------------------------------------------------------------ bucket sizes

def ds_buckets(hidden_size: int) -> dict[str, int]:
    """The DeepSpeed bucket sizes, in elements, memplan writes into its configs and estimates with.

    The values Hugging Face's integration fills in for "auto" (transformers integrations/deepspeed.py
    HfTrainerDeepSpeedConfig.trainer_config_finalize): reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size =
    int(0.9 hidden^2), stage3_param_persistence_threshold = 10 hidden; allgather as reduce;
    stage3_max_live_parameters DeepSpeed's default 1e9.
    """
    h2 = hidden_size * hidden_size
    return {"reduce_bucket_size": h2, "allgather_bucket_size": h2, "stage3_prefetch_bucket_size": int(0.9 * h2),
            "stage3_param_persistence_threshold": 10 * hidden_size, "stage3_max_live_parameters": 10 ** 9,
            "stage3_max_reuse_distance": 10 ** 9}


# ------------------------------------------------------------------------------------------------ per-tensor facts

def _unit(x) -> tuple | None:
    """The FSDP unit / ZeRO-3 gather scope of a parameter or Linear.

    Returns:
        (stack, block) for its transformer block, or None for the root unit (embeddings, final norm, head).
    """
    return (x.stack, x.block) if x.block is not None else None


def _units(ctx: Ctx) -> dict[tuple, list]:
    """Parameters grouped by unit (_unit)."""
    units: dict[tuple, list] = defaultdict(list)
    for p in ctx.spec.params + ctx.spec.media:  # a composite model's media parts: in the root unit
        units[_unit(p)].append(p)
    return units


def _lora_by_unit(ctx: Ctx) -> dict[tuple, int]:
    """LoRA adapter elements per unit (peft places lora_A/lora_B inside the targeted Linear's module)."""
    out: dict[tuple, int] = defaultdict(int)
    for m in ctx.lora:
        out[_unit(m)] += weights.adapter_numel(ctx, (m,))
    return out


def _param_bytes(ctx: Ctx) -> int:
    """Bytes per element of the parameters the engine stores on the GPU.

    16 bit under DeepSpeed bf16/fp16 (the module is cast), else the single-GPU weight dtype (FSDP shards the module
    as loaded: fp32 under mixed).
    """
    s = ctx.setup
    if s.engine == "deepspeed" and s.compute_dtype != "fp32" and not ctx.quantized:
        return ctx.compute_bytes
    return ctx.weight_bytes


def _optimizer_state_fp32(ctx: Ctx) -> int:
    """Optimizer state over the trainable tensors held in fp32 (the ZeRO/FSDP optimizer steps fp32 partitions)."""
    fn = opt.STATE_FN[ctx.setup.optimizer]
    return sum(fn(shape, 4) for shape, _ in opt.trainable_tensors(ctx))


# ------------------------------------------------------------------------------------------------ the model

@dataclasses.dataclass(frozen=True, slots=True)
class RankState:
    """What one rank holds besides the step's activations. Bytes."""

    weights: int  # base parameters resident on the GPU (sharded or replicated)
    lora_adapters: int  # adapter parameters resident on the GPU
    master_and_optimizer: int  # fp32 master copy (16-bit engines) + optimizer state, on the GPU
    gradients: int  # gradients held after backward (full, or the partition)
    comm_buffers: int  # persistent reduce/all-gather buckets (DDP buckets, ZeRO-3 ipg bucket)
    comm_backward: int  # buckets allocated for the backward only (ZeRO-1/2 ipg bucket)
    gathered_forward: int  # unsharded parameters alive at the forward peak (ZeRO-3 / FSDP)
    gathered_backward: int  # unsharded parameters + unsharded unit gradients alive during backward
    gathered_backward_end: int  # the same at the end of backward (shard-grad-op has resharded all but the last)
    gathered_head: int  # unsharded while the loss and the head run backward, before any block's
    step_temporaries: int  # optimizer-step buffers on the GPU (fp32 gradient partition, ...)
    host_bytes: int  # pinned host memory of this rank (offloaded state)
    nccl_device_bytes: int  # NCCL communicator buffers (outside PyTorch's allocator)


@per_model("optimizer", "lora_r", "added_tokens", "double_quant", "num_gpus", "num_nodes", "sharding", "offload")
def rank_state(ctx: Ctx) -> RankState:
    """Per-rank model state for ctx.setup.sharding (see the module docstring for the engines' layouts)."""
    s = ctx.setup
    n = s.world_size
    nccl = NCCL_DEVICE_BYTES if n > 1 else 0
    if s.sharding == "ddp":
        return _ddp(ctx, nccl)
    if s.engine == "deepspeed":
        return _zero(ctx, ZERO_STAGES[s.sharding], n, nccl)
    if s.sharding in FSDP_SHARDINGS:
        return _fsdp(ctx, n, nccl)
    raise ValueError(f"not a data-parallel setup: sharding={s.sharding!r}")


def _ddp(ctx: Ctx, nccl: int) -> RankState:
    """DDP: the single-GPU states as a full replica, plus gradient buckets of the gradients' total size."""
    grads = opt.gradient_bytes(ctx)
    return RankState(weights=weights.weights_bytes(ctx) + weights.quant_state_bytes(ctx),
                     lora_adapters=weights.lora_bytes(ctx), master_and_optimizer=opt.optimizer_state_bytes(ctx),
                     gradients=grads, comm_buffers=grads, comm_backward=0, gathered_forward=0, gathered_backward=0,
                     gathered_backward_end=0, gathered_head=0,
                     step_temporaries=opt.optimizer_temp_bytes(ctx), host_bytes=0, nccl_device_bytes=nccl)


def _zero(ctx: Ctx, stage: int, n: int, nccl: int) -> RankState:
    """DeepSpeed ZeRO stage 1/2/3 (deepspeed 0.19: runtime/zero/stage_1_and_2.py, stage3.py).

    Stage 1/2: the full 16-bit module; 16-bit gradients in full until the step (stage 1) or reduced during backward
    into a contiguous partition (stage 2); one reduce bucket allocated for each backward (overlap_comm off, as we
    write it); the step upcasts the gradient partition to fp32. Optimizer offload moves the fp32 master, Adam state
    and gradient partition to pinned host memory (a GPU staging buffer of the largest parameter stays).
    Stage 3: 16-bit partitions (parameters at or below stage3_param_persistence_threshold stay whole on every
    rank), a persistent 16-bit flat gradient-partition buffer, one persistent reduce bucket, the gathered
    parameters of the running module plus the prefetch bucket, and per optimizer sub-group (sub_group_size 1e9) a
    16-bit flat copy and an fp32 copy of the gradients at the step. Optimizer offload moves the gradient buffer,
    fp32 partitions and state to the host; parameter offload the 16-bit partitions too."""
    s = ctx.setup
    pb = _param_bytes(ctx)
    sixteen = pb < 4  # 16-bit engine: fp32 master partition next to the optimizer state
    gb = pb  # gradients take the (engine) parameter dtype
    buckets = ds_buckets(ctx.spec.arch.hidden_size)
    t = weights.trainable_numel(ctx)
    lora_numel = weights.lora_numel(ctx)
    base = sum(weights.stored_bytes(ctx, p, pb) for p in ctx.spec.params + ctx.spec.media) + \
        weights.quant_state_bytes(ctx)
    states = (t * 4 if sixteen else 0) + _optimizer_state_fp32(ctx)
    offload_opt = s.offload in ("optimizer", "params+optimizer")
    offload_par = s.offload == "params+optimizer"
    reduce_bucket = min(buckets["reduce_bucket_size"], t) * gb
    partition = math.ceil(t / n)
    host = (math.ceil(states / n) + partition * 4) if offload_opt else 0  # + the fp32 gradient partition
    retained = 0
    if stage == 3:
        persistent = sum(weights.stored_bytes(ctx, p, pb) for p in ctx.spec.params + ctx.spec.media
                         if p.numel <= buckets["stage3_param_persistence_threshold"])
        sharded = base - persistent
        resident = persistent + (0 if offload_par else math.ceil(sharded / n))
        largest = max((m.in_features * m.out_features for m in ctx.spec.linears), default=0)
        live = largest + min(buckets["stage3_max_live_parameters"], buckets["stage3_prefetch_bucket_size"])
        gathered = live * pb
        # a gathered parameter is not released when it is used again within stage3_max_reuse_distance elements
        # (partitioned_param_coordinator.py __params_to_release): the blocks nearest the forward/backward
        # turnaround (reuse distance 2 x the elements after them) stay gathered from their forward to their backward
        retained = min(ctx.spec.numel_total, buckets["stage3_max_reuse_distance"] // 2) * pb
        # no more than the whole model is ever gathered: where the retained blocks are all of it, the running module
        # is one of them
        retained = min(retained, ctx.spec.numel_total * pb - gathered)
        grads = 0 if offload_opt else partition * gb
        comm, comm_backward = reduce_bucket, 0
        sub_group = min(SUB_GROUP_SIZE, partition)
        step_tmp = 0 if offload_opt else sub_group * (gb + 4)
        lora = 0 if offload_par else math.ceil(lora_numel * pb / n)
        if offload_par:
            host += math.ceil((sharded + lora_numel * pb) / n)
    else:
        resident, gathered, lora = base, 0, lora_numel * pb
        # stage 2's contiguous gradient buffer covers every parameter that touches the rank's partition in full
        # (stage_1_and_2.py grads_in_partition): the partition plus up to the largest trainable tensor
        largest_t = max((weights.numel(ctx, p) for p in ctx.spec.params if p.name in ctx.trainable), default=0)
        grads = t * gb if stage == 1 else (0 if offload_opt else (partition + largest_t) * gb)
        comm = largest_t * gb if offload_opt else 0  # the GPU staging buffer of optimizer offload
        comm_backward = reduce_bucket
        # the step's gradient norm runs in fp64 (get_norm_dtype() on CUDA) over the partition: 8 B per element,
        # more than the fp32 copy of the partition made next
        step_tmp = 0 if offload_opt else partition * 8
    step_tmp += 0 if offload_opt else math.ceil(opt.optimizer_temp_bytes(dataclasses.replace(ctx, weight_bytes=4)) / n)
    return RankState(weights=resident, lora_adapters=lora, master_and_optimizer=0 if offload_opt else math.ceil(states / n),
                     gradients=grads, comm_buffers=comm, comm_backward=comm_backward,
                     gathered_forward=gathered + retained, gathered_backward=gathered + retained,
                     gathered_backward_end=gathered, gathered_head=gathered + retained, step_temporaries=step_tmp,
                     host_bytes=host, nccl_device_bytes=nccl)


def _fsdp(ctx: Ctx, n: int, nccl: int) -> RankState:
    """PyTorch FSDP with transformer-block auto-wrapping (accelerate's TRANSFORMER_BASED_WRAP).

    Sharded flat parameters per unit, unsharded compute copies while a unit runs (one unit prefetched ahead: FSDP1
    BackwardPrefetch.BACKWARD_PRE / FSDP2's implicit prefetch), the root unit unsharded from forward to backward
    (FSDP2 fully_shard: the root's reshard_after_forward is False)."""
    s = ctx.setup
    wb = ctx.weight_bytes
    cb = ctx.compute_bytes
    units = _units(ctx)
    lora_units = _lora_by_unit(ctx)

    def unit_bytes(key, per: float) -> float:
        return sum(weights.stored_bytes(ctx, p, per) for p in units.get(key, ())) + lora_units.get(key, 0) * per

    base = sum(weights.stored_bytes(ctx, p, wb) for p in ctx.spec.params + ctx.spec.media) + \
        weights.quant_state_bytes(ctx)
    lora = weights.lora_numel(ctx) * 4
    t = weights.trainable_numel(ctx)
    trainable_units = _trainable_by_unit(ctx)
    blocks = [k for k in units if k is not None]
    block = max((unit_bytes(k, cb) for k in blocks), default=0)
    block_grad = max((trainable_units.get(k, 0) for k in blocks), default=0) * cb
    root = unit_bytes(None, cb)
    end = root + 2 * block + 2 * block_grad  # unsharded grads + the reduce-scatter input copy
    if s.sharding == "fsdp-shard-grad-op":  # nothing resharded between a unit's forward and its backward
        fwd = root + sum(unit_bytes(k, cb) for k in blocks)
        bwd = head = fwd + 2 * block_grad
    else:
        # the last block is resharded after its forward; the root's pre-backward (on the logits) prefetches it again
        # at the loss's backward: the root and one block unsharded there, no unit's gradients yet
        fwd, bwd, head = root + 2 * block, end, root + block
    offload = s.offload == "params+optimizer"
    states = opt.optimizer_state_bytes(ctx)  # over the shards in their stored dtype
    host = math.ceil((base + lora + t * wb + states) / n) if offload else 0
    return RankState(weights=0 if offload else math.ceil(base / n), lora_adapters=0 if offload else math.ceil(lora / n),
                     master_and_optimizer=0 if offload else math.ceil(states / n),
                     gradients=0 if offload else math.ceil(t * wb / n), comm_buffers=0, comm_backward=0,
                     gathered_forward=int(fwd), gathered_backward=int(bwd), gathered_backward_end=int(end),
                     gathered_head=int(head),
                     step_temporaries=0 if offload else math.ceil(opt.optimizer_temp_bytes(ctx) / n),
                     host_bytes=host, nccl_device_bytes=nccl)


def _trainable_by_unit(ctx: Ctx) -> dict[tuple, int]:
    """Trainable elements per unit (_unit), LoRA adapters included."""
    out: dict[tuple, int] = defaultdict(int)
    for p in ctx.spec.params:
        if p.name in ctx.trainable:
            out[_unit(p)] += weights.numel(ctx, p)
    for k, v in _lora_by_unit(ctx).items():
        out[k] += v
    return out
