"""TRL's activation offloading (Setup.activation_offloading; trl/models/activation_offloading.py, 1.16): what stays
on the device of the tensors a checkpointed step saves, and what moves to host memory.

With checkpointing each block saves only its input (torch.utils.checkpoint's _NoopSaveInputs, outside the
checkpoint's own hooks, so the offloading hooks see it). OffloadActivations copies every saved tensor of at least
1 KiB to pinned host memory; the device keeps it only while it is in the 5-deep forward stash, and the backward
brings each back as its block is recomputed, dropping it once the next autograd node has run. Traced
(memplan.runtime.offload): at every moment of the backward two block inputs are on the device, the first block's
(the embedding output, which the step also holds) and the one brought back; the rest are on the host.
"""
from __future__ import annotations

from memplan.estimator.memory.activations import per_block_bytes
from memplan.estimator.memory.context import Ctx

#: block inputs on the device at once under offloading: the first block's and the one being recomputed
RESIDENT_INPUTS = 2


def offloads(ctx: Ctx) -> bool:
    """Whether the step offloads its checkpointed blocks' inputs (activation_offloading, which the setup allows
    with checkpointing only)."""
    return ctx.training and ctx.setup.activation_offloading and ctx.setup.grad_ckpt


def device_block_saves(ctx: Ctx, checkpointed: list[float]) -> float:
    """The checkpointed blocks' saved inputs that stay on the device (RESIDENT_INPUTS of the largest)."""
    return sum(sorted(checkpointed, reverse=True)[:RESIDENT_INPUTS])


def host_bytes(ctx: Ctx) -> int:
    """Pinned host memory the offloaded block inputs take at the end of the forward (per GPU process): every block's
    saved input but those on the device."""
    if not offloads(ctx):
        return 0
    checkpointed = [ck for _, ck in per_block_bytes(ctx)]
    return int(sum(checkpointed) - device_block_saves(ctx, checkpointed))
