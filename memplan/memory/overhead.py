"""What the device holds beyond live tensors: CUDA context, cuBLAS workspace, caching-allocator reserve."""
from __future__ import annotations

from memplan.memory.context import Ctx
from memplan.units import MiB

#: CUDA context of a PyTorch process with lazy module loading (default since PyTorch 1.13, pytorch/pytorch#86509:
#: 287 MB right after init) once training kernels are loaded. 426 MiB measured after the first CUDA call on an
#: RTX 6000 Ada with PyTorch 2.10 (unslothai/unsloth-zoo#1053); "around 400MB" (pytorch/pytorch#109888). cuBLAS/cuDNN
#: and flash kernels loaded by a training step add to it; 512 MiB until our own measurements (issue 6) replace it.
CUDA_CONTEXT_BYTES = 512 * MiB

#: cuBLAS workspace PyTorch allocates through its caching allocator on the first matmul
#: (aten/src/ATen/cuda/CublasHandlePool.cpp, default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" = 2x4 MiB + 8x16 KiB),
#: plus the 1 MiB cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE default 1024 KiB).
CUBLAS_WORKSPACE_BYTES = 2 * 4096 * 1024 + 8 * 16 * 1024 + 1024 * 1024

#: Caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests > 10 MiB get their own segment rounded up to a
#: 2 MiB multiple (kRoundLarge); smaller ones are carved from 2 MiB / 20 MiB segments.
LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB

#: Fraction of the transient peak (activations, logits, temporaries) held as free-but-reserved blocks at the
#: reserved peak: blocks freed in backward are split/reused for differently sized requests. Provisional value
#: pending the GPU measurements of issue 6 (DESIGN.md field notes: "reserved > allocated").
TRANSIENT_FRAGMENTATION = 0.10


def rounding_waste(tensor_bytes: list[int] | tuple[int, ...]) -> int:
    """Bytes lost rounding large persistent tensors to 2 MiB segments (each > 10 MiB request: up to 2 MiB)."""
    waste = 0
    for n in tensor_bytes:
        if n > LARGE_ALLOC:
            waste += -n % ROUND_LARGE
    return waste


def persistent_tensor_sizes(ctx: Ctx) -> list[int]:
    """Sizes of the resident tensors allocated one by one: each weight, and per trainable weight its gradient and
    (Adam) two states of the same size."""
    sizes = [p.numel * ctx.weight_bytes for p in ctx.spec.params]
    if ctx.training:
        per = 3 if ctx.setup.optimizer in ("adamw", "adamw-fused") else 1
        sizes += [p.numel * ctx.weight_bytes for p in ctx.spec.params if p.name in ctx.trainable] * per
    return sizes


def allocator_reserve_bytes(ctx: Ctx, transient_bytes: int) -> int:
    """reserved - allocated at the peak: rounding of large persistent tensors + fragmentation of the transients."""
    return rounding_waste(persistent_tensor_sizes(ctx)) + int(TRANSIENT_FRAGMENTATION * transient_bytes)
