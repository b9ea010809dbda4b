"""What the device holds beyond live tensors: CUDA context, cuBLAS workspace, caching-allocator reserve."""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory.weights import numel
from memplan.units import MiB

#: CUDA context of a PyTorch process with lazy module loading (default since PyTorch 1.13, pytorch/pytorch#86509)
#: once training kernels are loaded; cuBLAS/cuDNN and flash kernels loaded by a training step add to it. Other
#: reports: pytorch/pytorch#109888, unslothai/unsloth-zoo#1053.
#: Measured: data/measured/gpu-h100.csv cuda_context_bytes (NVML used memory after torch.cuda.init less before).
CUDA_CONTEXT_BYTES = 548_995_072


#: Caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests > 10 MiB get their own segment rounded up to a
#: 2 MiB multiple (kRoundLarge); smaller ones are carved from 2 MiB / 20 MiB segments.
LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB

#: Fraction of the transient peak (activations, logits, temporaries) held as free-but-reserved blocks at the
#: reserved peak: blocks freed in backward are split/reused for differently sized requests. With checkpointing each
#: block's recompute allocates and frees its full activations between the gradients backward allocates, so more of
#: the cache ends up split. Inference keeps the training value. Both are medians, not a per-row fit: reserved stays
#: a looser prediction than allocated (benchmarks/results/accuracy.md), and the planner does not use it
#: (memplan.planner.budget).
#: Measured: data/measured/gpu-h100.csv (reserved - allocated - rounding_waste over the estimate's transient).
TRANSIENT_FRAGMENTATION = 0.10
TRANSIENT_FRAGMENTATION_CKPT = 0.28

#: Under a memory cap the allocator frees its unsplit cached segments before it reports an OOM, but not the free
#: space split inside segments that still hold live tensors. Without checkpointing that space stayed below the
#: planner's headroom (no planner run without checkpointing ran out of memory with over 0.4% of the usable memory
#: spare); with it each block's recompute splits the cache between the gradients, and 4 checkpointed planned
#: batches (QLoRA Llama-2-7B, DPO LoRA and full, GRPO LoRA) ran out with 3.7-5.8% spare. This share of the
#: activations alive at the peak is held for it; fitted on those runs (in-sample: 8.6% is the smallest share that
#: predicts all four; 10% costs one fitting planned batch, GRPO on an L4: 64 where 72 fits).
#: Measured: data/measured/planner-check.csv (H200 capped to each card, 2026-11-27), docs/PLANNER.md "Budget".
CAP_FRAGMENTATION_CKPT = 0.10


def rounding_waste(tensor_bytes: list[int] | tuple[int, ...]) -> int:
    """Bytes lost rounding large persistent tensors to 2 MiB segments (each > 10 MiB request: up to 2 MiB)."""
    waste = 0
    for n in tensor_bytes:
        if n > LARGE_ALLOC:
            waste += -n % ROUND_LARGE
    return waste


def persistent_tensor_sizes(ctx: Ctx) -> list[int]:
    """Sizes of the resident tensors allocated one by one.

    Each weight, and per trainable weight its gradient and (Adam) two states of the same size.
    """
    sizes = [numel(ctx, p) * ctx.weight_bytes for p in ctx.spec.params + ctx.spec.media]
    if ctx.training:
        per = 3 if ctx.setup.optimizer in ("adamw", "adamw-fused") else 1
        sizes += [numel(ctx, p) * ctx.weight_bytes for p in ctx.spec.params if p.name in ctx.trainable] * per
    return sizes


@per_model("optimizer", "added_tokens")
def persistent_rounding_waste(ctx: Ctx) -> int:
    """rounding_waste of the persistent tensors, once per model and selection."""
    return rounding_waste(persistent_tensor_sizes(ctx))


def cap_fragmentation_bytes(ctx: Ctx, activation_bytes: int) -> int:
    """Free space a capped allocator cannot release at the peak (CAP_FRAGMENTATION_CKPT): checkpointed training
    only; part of the planner's need, not of the allocated or reserved peak."""
    return int(CAP_FRAGMENTATION_CKPT * activation_bytes) if ctx.training and ctx.setup.grad_ckpt else 0


def allocator_reserve_bytes(ctx: Ctx, transient_bytes: int) -> int:
    """reserved - allocated at the peak: rounding of large persistent tensors + fragmentation of the transients."""
    frag = TRANSIENT_FRAGMENTATION_CKPT if ctx.training and ctx.setup.grad_ckpt else TRANSIENT_FRAGMENTATION
    return persistent_rounding_waste(ctx) + int(frag * transient_bytes)
