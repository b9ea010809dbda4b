"""What the backward holds at the blocks it starts and ends with.

It reaches the last block first (recomputed under checkpointing) and the first recording block last, with nearly
every gradient written; the largest moments inside a block are its MLP product's backward
(phases._backward_temp_bytes) and, with eager or math attention, its softmax's backward. By then the block's
backward has freed what was saved after that point (the autograd engine runs nodes in reverse creation order:
memplan.estimator.memory.block_tail) and not yet written the gradients of the weights before it.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

from memplan.estimator.memory import activations as act
from memplan.estimator.memory.attention import attention_kernel, attn_core, softmax_out_bytes
from memplan.estimator.memory.block_tail import mlp_out_bytes, post_attention_bytes
from memplan.estimator.memory.context import Ctx, per_model
from memplan.model.layout import BlockLayout, blocks
from memplan.estimator.memory.saves import norm_keeps_input
from memplan.estimator.memory.weights import numel


class EndBlock(NamedTuple):
    blk: BlockLayout
    trained: bool  # its base parameters train
    full: float  # what it saves without checkpointing (activations.per_block_bytes)
    checkpointed: float  # its checkpoint input
    tokens: int
    recompute: float  # what its recompute adds beside its checkpoint input (_recompute_bytes)
    mlp_out: float  # what its MLP output projection saves, freed before the product's backward (block_tail)


def recording(ctx: Ctx, sizes: list[tuple[float, float]]) -> list[EndBlock]:
    """The blocks that record, in execution order: one per structure, plus the first and the last themselves.

    Blocks of one structure save alike, so one row stands for all of them (speed: 80-layer models).
    sizes: activations.per_block_bytes(ctx).
    """
    rows, seen, lora, last = [], set(), act._lora_names(ctx), None
    for (blk, shape, trained, starts), (full, ck) in zip(act._block_structure(ctx), sizes):
        if shape is None:
            continue
        last = (blk, shape, trained, starts, full, ck)
        if (shape, starts, full) not in seen:
            seen.add((shape, starts, full))
            rows.append(_end(ctx, blk, trained, starts, full, ck, lora))
    if last and rows[-1].blk is not last[0]:
        blk, _, trained, starts, full, ck = last
        rows.append(_end(ctx, blk, trained, starts, full, ck, lora))
    return rows


def stack_last(ctx: Ctx, sizes: list[tuple[float, float]], stack: str) -> EndBlock | None:
    """The last recording block of `stack`, or None without one.

    For an encoder-decoder's "encoder" this is the first of its blocks the backward reaches.
    sizes: activations.per_block_bytes(ctx).
    """
    found = None
    for (blk, shape, trained, starts), (full, ck) in zip(act._block_structure(ctx), sizes):
        if shape is not None and blk.stack == stack:
            found = (blk, trained, starts, full, ck)
    return _end(ctx, *found, act._lora_names(ctx)) if found else None


def _end(ctx: Ctx, blk: BlockLayout, trained: bool, starts: bool, full: float, ck: float, lora) -> EndBlock:
    tokens = act.stack_tokens(ctx, blk.stack)[0]
    return EndBlock(blk, trained, full, ck, tokens, _recompute_bytes(ctx, blk, trained, starts, full, tokens),
                    mlp_out_bytes(ctx, blk, lora) * tokens)


def _recompute_bytes(ctx: Ctx, blk: BlockLayout, trained: bool, starts: bool, full: float, tokens: int) -> float:
    """Bytes a checkpointed block's recompute saves.

    What the block saves, less its input norm's saved input where that is the checkpoint input itself, alive
    anyway (saves.norm_keeps_input: LayerNorm, RMSNorm on an fp32 stream).
    """
    a = ctx.spec.arch
    if a.post_norm or not blk.norms or (starts and not trained) or not norm_keeps_input(ctx, trained):
        return full  # a post-LN block's first ops are its projections; the first recording block's norm saves nothing
    return full - tokens * a.hidden_size * ctx.residual_bytes


def largest_recompute_bytes(ctx: Ctx, rows: list[EndBlock], at_mlp: bool = False) -> float:
    """The largest recompute of a checkpointed block, 0 without checkpointing.

    at_mlp: at its MLP product's backward, less what its MLP output projection saved. The largest block is not the
    last where an encoder's blocks see more tokens than the decoder's.
    """
    if not ctx.setup.grad_ckpt:
        return 0.0
    return max((e.recompute - (e.mlp_out if at_mlp else 0) for e in rows), default=0.0)


def end_blocks(rows: list[EndBlock]) -> tuple[EndBlock, EndBlock] | None:
    """The two blocks the backward ends and starts with.

    Returns:
        (the first recording block, the last block) in execution order; None when no block records.
    """
    return (rows[0], rows[-1]) if rows else None


def pending_grad_bytes(ctx: Ctx, end: EndBlock) -> int:
    """Bytes of the block's base weight gradients not yet written at its MLP product's backward.

    Every trainable parameter of the block but the MLP output projection's (LoRA's small ones left in).
    """
    return _grads_of(ctx, end, 0)


def block_grad_bytes(ctx: Ctx, end: EndBlock) -> int:
    """Every base weight gradient of the block: none is written yet while its recompute runs."""
    return _grads_of(ctx, end, 2)


def _grads_of(ctx: Ctx, end: EndBlock, which: int) -> int:
    """Bytes of one of _block_grads' counts for the block."""
    return _block_grads(ctx).get((end.blk.stack, end.blk.index), (0, 0, 0))[which] * ctx.weight_bytes


@per_model()
def _block_grads(ctx: Ctx) -> MappingProxyType:
    """Trainable element counts per block, once per model and selection (speed: one walk over every parameter).

    Returns:
        (stack, index) -> (trainable elements but the MLP output projection's, the q/k/v projections' elements,
        all trainable elements).
    """

    slots = {}
    for blk in blocks(ctx.spec):
        for sl, m in blk.linears:
            slots[m.name] = sl
    out: dict[tuple, list[int]] = {}
    for p in ctx.spec.params:
        if p.block is None or p.name not in ctx.trainable:
            continue
        sl = slots.get(p.name.rsplit(".", 1)[0])
        row = out.setdefault((p.stack, p.block), [0, 0, 0])
        n = numel(ctx, p)
        row[0] += 0 if sl == "mlp_out" else n
        row[1] += n if sl == "attn_in" else 0
        row[2] += n
    return MappingProxyType({k: tuple(v) for k, v in out.items()})


def attention_backward_freed_bytes(ctx: Ctx, rows: list[EndBlock], largest: float) -> float:
    """What the last block has freed by its attention's softmax backward, plus `largest` above its own recompute.

    The last block is the first the backward reaches (recomputed under checkpointing); its freed bytes are
    attention_freed_bytes. largest: largest_recompute_bytes(ctx, rows).
    """
    ends = end_blocks(rows)
    if ends is None or ends[1].blk is not blocks(ctx.spec)[-1]:
        return 0.0
    last = ends[1]
    if not ctx.setup.grad_ckpt:  # no recompute: its saves are among the activations
        return attention_freed_bytes(ctx, last)
    if any(e.recompute > last.recompute and e.blk.stack != last.blk.stack for e in rows):
        return 0.0  # the largest recompute is an encoder's (its own phase: attention_phases.encoder_backward_phase)
    # another block of the same stack may recompute more (T5's first decoder block computes the position bias): the
    # moment is still the last block's, so `largest` gives way to its own recompute
    return largest - last.recompute + attention_freed_bytes(ctx, last)


def attention_freed_bytes(ctx: Ctx, end: EndBlock) -> float:
    """What a block's backward has freed by its attention's softmax backward.

    Its post-attention saves (post_attention_bytes) and, of the probabilities, all but the softmax's output and
    Gemma-2's tanh: PV's backward freed the compute-dtype or dropped copy and dropout's mask. A decoder's
    cross-attention runs its backward first, so its own probabilities over [target, source] are the ones freed.
    """
    blk, trained, tokens = end.blk, end.trained, end.tokens
    a = ctx.spec.arch
    s_q = act.stack_tokens(ctx, blk.stack)[1][0]
    kernel = attention_kernel(ctx, relative_bias=True)
    freed = post_attention_bytes(ctx, blk, act._lora_names(ctx), trained, kernel) * tokens
    if kernel == "fused":
        return freed
    s_k = ctx.src_len if blk.stack == "decoder" and a.kind == "seq2seq" else s_q
    per_score = attn_core(ctx, 1, 1, 1, 1, kernel)[1]
    kept = softmax_out_bytes(ctx, kernel) + (ctx.act_bytes if a.attn_logit_softcap and kernel == "eager" else 0)
    return freed + a.num_heads * s_q * s_k * max(per_score - kept, 0) * (tokens // max(s_q, 1))


def attention_pending_grad_bytes(ctx: Ctx, end: EndBlock) -> int:
    """Bytes of the block's base weight gradients not yet written at its attention's softmax backward.

    Those of its q/k/v projections (layout slot attn_in), which read the normed input the softmax's backward has
    not reached.
    """
    return _grads_of(ctx, end, 1)
