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


def allocator_reserve_bytes(ctx: Ctx, transient_bytes: int) -> int:
    """reserved - allocated at the peak: rounding of large persistent tensors + fragmentation of the transients."""
    frag = TRANSIENT_FRAGMENTATION_CKPT if ctx.training and ctx.setup.grad_ckpt else TRANSIENT_FRAGMENTATION
    return persistent_rounding_waste(ctx) + int(frag * transient_bytes)
