"""The attention masks a training or inference step keeps, in bytes.

Eager's additive float masks, sdpa's boolean ones past a sliding window or with padding, and before transformers
4.53 one shared float mask.
"""
from __future__ import annotations

from memplan.estimator.memory.attention import BOOL_MASKS_SINCE, padded_masks, sdpa_integration_before, windowed
from memplan.estimator.memory.context import Ctx


def mask_bytes(ctx: Ctx) -> int:
    """Bytes of the attention masks the model's forward builds and keeps for its whole duration.

    Eager attention materialises a [b, 1, s, s] additive mask in the hidden dtype for the whole forward
    (transformers masking_utils eager_mask), one per mask kind (Gemma2 builds its full and its sliding mask even
    below the window); sdpa without padding passes is_causal instead, except past a sliding window: a boolean
    [b, 1, s, s] mask (masking_utils sdpa_mask; attention.windowed). With padding (Setup.padded) sdpa gets a boolean
    mask of every kind, and an encoder-decoder's cross-attention one [b, 1, t, s] (its decoder's is skipped).
    """
    a = ctx.spec.arch
    square = ctx.setup.batch_size * ctx.src_len * ctx.src_len
    if shared_float_mask(ctx):
        return square * ctx.residual_bytes
    if ctx.attn_impl == "sdpa":
        if padded_masks(ctx):
            cross = ctx.setup.batch_size * ctx.tgt_len * ctx.src_len if a.kind == "seq2seq" else 0
            return square * a.mask_kinds + cross
        return square if windowed(ctx) else 0
    if ctx.attn_impl != "eager":
        return 0
    return square * ctx.residual_bytes * a.mask_kinds


def checkpointed_mask_bytes(ctx: Ctx) -> int:
    """The masks alive in backward: with checkpointing all of them, else none (but a shared float mask).

    With checkpointing the masks are inputs of every checkpointed block, kept for its recompute until the backward
    is done (torch.utils.checkpoint saves the inputs); without it they die with the model's forward, before the loss.
    """
    return mask_bytes(ctx) if ctx.setup.grad_ckpt or shared_float_mask(ctx) else 0


def shared_float_mask(ctx: Ctx) -> bool:
    """A padded or windowed sdpa model gets one float mask per forward (transformers before 4.53).

    The [b, 1, s, s] mask is in the hidden states' dtype (attention.BOOL_MASKS_SINCE), and every layer's kernel keeps
    it for backward: alive until the first layer's backward, with or without checkpointing.
    """
    return (sdpa_integration_before(ctx, BOOL_MASKS_SINCE)
            and (ctx.setup.padded or windowed(ctx)))
