"""The T5 family's learned relative position bias (T5, mT5, UMT5) and what it costs.

Whether a model has one, the float masks sdpa builds from it and keeps, the bucket indices its embedding's backward
keeps, and the decoder's cross-attention bias passed from layer to layer. Split from
memplan.estimator.memory.attention, which decides the kernel these masks meet.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.recording import graph_blocks


def has_position_bias(a) -> bool:
    """The model has a learned relative position bias (Arch.relative_bias_layers, read from the model).

    It reaches every attention layer as a [b, heads, q, k] float tensor (T5Attention.compute_bias + mask), kept for
    backward by sdpa's efficient kernel. T5, mT5, UMT5.
    """
    return a.relative_bias_layers > 0


def bias_per_layer(a) -> bool:
    """Every layer computes its own bias instead of the stack's first layer passing one on (T5: one per stack).

    UMT5: relative_attention_bias in each self-attention, a zero bias built by each cross-attention.
    """
    return a.relative_bias_layers > 2


def bias_mask_dtype_bytes(ctx: Ctx) -> int:
    """Bytes per element of the float mask sdpa keeps.

    Autocast's compute-dtype cast of it under mixed precision (sdpa is on autocast's lower-precision list), else the
    bias's own dtype (the residual dtype of the embedding it comes from).
    """
    return ctx.compute_bytes if ctx.mixed else ctx.residual_bytes


def self_bias_mask_bytes(ctx: Ctx, batch: int, q_len: int, kernel: str, stack: str | None = None) -> float:
    """The mask one T5/mT5 self-attention keeps under a fused sdpa kernel (transformers >= 5.20).

    Every layer's call builds its own [b, heads, q, q] mask from the shared position bias
    (integrations/sdpa_attention.py create_position_bias_mask: merged with the padding or causal mask, then
    `.contiguous()`; autocast casts it again), which the kernel keeps for backward - one per layer, not one per stack.
    Its batch dimension comes from the padding mask: an encoder's with padding (Setup.padded), else the bias's own 1 (a
    decoder's all-ones mask is skipped: is_causal merges a [1, 1, q, q] causal mask). Math kernel (older transformers):
    added to the scores, nothing kept.
    """
    a = ctx.spec.arch
    if not has_position_bias(a) or ctx.attn_impl != "sdpa" or kernel != "fused":
        return 0.0
    rows = batch if ctx.setup.padded and stack != "decoder" else 1
    return rows * a.num_heads * q_len * q_len * bias_mask_dtype_bytes(ctx)


def bias_bucket_bytes(ctx: Ctx, stack: str | None, index: int, q_len: int) -> int:
    """The int64 relative position buckets a trainable relative position bias keeps for backward.

    The bias (T5: in the first layer of each stack; UMT5: in every layer) is an embedding looked up with the [q, k]
    buckets, which its backward keeps (aten embedding_backward needs the indices).
    """
    if not has_position_bias(ctx.spec.arch):
        return 0
    return sum(q_len * q_len * 8 for p in ctx.spec.params
               if p.block == index and p.stack == stack and "relative_attention_bias" in p.name
               and p.name in ctx.trainable)


def position_bias_bytes(ctx: Ctx) -> float:
    """T5/mT5 decoders: the cross-attentions' zero bias [1, heads, q_len, k_len] and its merged copies.

    The first decoder layer builds the bias and passes it on (UMT5: every layer, bias_per_layer). Each sdpa call
    merges it with the encoder's padding mask (integrations/sdpa_attention.py create_position_bias_mask, every
    transformers 5 release): with padding a [b, heads, q, k] copy per layer, kept by the kernel; without, the bias
    itself. The self-attentions' per-layer masks are in the blocks (self_bias_mask_bytes). Only a recorded decoder
    keeps it (graph_blocks).
    """
    a = ctx.spec.arch
    if not has_position_bias(a) or ctx.attn_impl == "eager":
        return 0.0  # eager adds the bias to the scores, which saves nothing
    recorded = {stack for stack, _ in graph_blocks(ctx)}
    if a.kind != "seq2seq" or "decoder" not in recorded:
        return 0.0
    decoder_layers = sum(1 for stack, _ in graph_blocks(ctx) if stack == "decoder")
    layers, rows = decoder_layers if bias_per_layer(a) else 1, ctx.setup.batch_size
    if ctx.attn_impl == "sdpa":
        # checkpointed, no layer's kernel keeps its merged copy: the checkpoints hold the bias itself
        per_layer = ctx.setup.padded and not ctx.setup.grad_ckpt
        layers, rows = (decoder_layers, rows) if per_layer else (layers, 1)
        if ctx.setup.grad_ckpt and bias_per_layer(a):  # UMT5: each layer's own bias is recomputed, never passed on
            layers = 1
    return layers * rows * a.num_heads * ctx.tgt_len * ctx.src_len * bias_mask_dtype_bytes(ctx)
