"""The phases of a training step inside an attention, in bytes per component.

Moments inside the blocks' forward (a checkpointed block at its softmax or MLP, DeepSeek-V3.2's indexer), the
softmax's backward in the last block (the first the backward reaches) and in the first recording block (the last,
with nearly every gradient written), an encoder-decoder's encoder's last block beside the decoder's gradients, and a
checkpointed block's indexer in the backward's recompute. The softmax moments are the eager and math kernels' only:
fused kernels work tile by tile and add nothing there. memplan.estimator.phases assembles them with the step's other
phases.
"""
from __future__ import annotations

from memplan.estimator.memory import block_ends, dora, forward_block, quant
from memplan.estimator.memory.attention import score_grad_bytes
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.masks import checkpointed_mask_bytes, mask_bytes
from memplan.estimator.memory import logits as lg, weights
from memplan.model.layout import blocks


def largest(*moments: dict[str, int]) -> dict[str, int]:
    """The moment with the most bytes alive (components summed): a phase's peak among the moments it may be."""
    return max(moments, key=lambda parts: sum(parts.values()))


def in_forward_phases(ctx: Ctx, common: dict, before_head: int, blocks: list) -> dict:
    """The forward_block, forward_dora and forward_indexer phases: moments inside the blocks' forward.

    Each holds what the blocks before it saved and the embeddings' saves (`before_head`: the head's side comes
    later), the blocks' autocast copies (not yet the head's) and the masks. forward_block, checkpointing with an
    eager or math attention: the last block at its softmax or its MLP (forward_block.working_bytes).
    forward_dora: the last block's largest DoRA layer rebuilding its weight norm (memory.dora.dora_temp_bytes).
    forward_indexer, DeepSeek-V3.2: the last layer's indexer (forward_block.indexer_bytes); without checkpointing
    the last block has saved only its input and what its attention holds (counted there), so its whole saves are
    left out of `before_head`. blocks: activations.per_block_bytes(ctx).
    """
    works = {"forward_block": forward_block.working_bytes(ctx) if ctx.setup.grad_ckpt else 0,
             "forward_indexer": forward_block.indexer_bytes(ctx), "forward_dora": dora.dora_temp_bytes(ctx)}
    if not any(works.values()):
        return {}
    at = {**common, "activations": before_head, "attention_mask": mask_bytes(ctx),
          "autocast_weight_copies": common["autocast_weight_copies"] - quant.outside_cast_bytes(ctx)}
    phases = {name: {**at, ("dora_temporaries" if name == "forward_dora" else "forward_temporaries"): work}
              for name, work in works.items() if work}
    if "forward_indexer" in phases and not ctx.setup.grad_ckpt:
        a = ctx.spec.arch
        block_input = ctx.setup.batch_size * max(ctx.src_len, ctx.tgt_len) * a.hidden_size * ctx.residual_bytes
        own = blocks[-1][0] if blocks else 0
        phases["forward_indexer"]["activations"] = int(before_head - own + block_input)
    return phases


def attention_backward_phase(ctx: Ctx, res: dict, held: int, activations: int, back: dict) -> dict:
    """The attention_backward phase: the last block's softmax backward, eager and math attention only.

    It runs after the head's backward (the logits gradients and the lm_head's autocast copy are gone) and holds the
    saved activations (with checkpointing, the block recomputed) less what that block's backward freed before
    (block_ends.attention_backward_freed_bytes), the in-block autocast copies (`back`'s), the hidden-state gradients
    and the score-sized gradients (attention.score_grad_bytes). An encoder-decoder's last block is the decoder's:
    its target tokens, its scores against the longer of the target and the source (self- or cross-attention).
    Fused kernels add nothing here.
    """
    s, a = ctx.setup, ctx.spec.arch
    q_len = ctx.tgt_len if a.kind == "seq2seq" else max(ctx.src_len, ctx.tgt_len)
    scores = score_grad_bytes(ctx, q_len, max(ctx.src_len, ctx.tgt_len))
    if not scores:
        return {}
    tokens = s.batch_size * q_len
    return {"attention_backward": {
        **res, "gradients": held or lg.head_grad_bytes(ctx), "activations": activations,
        "autocast_weight_copies": back["autocast_weight_copies"],
        "attention_mask": back["attention_mask"],
        "backward_temporaries": 2 * tokens * a.hidden_size * ctx.residual_bytes + scores}}


def first_attention_backward_phase(ctx: Ctx, res: dict, grads: int, first, embeds: int, deq: int) -> dict:
    """The first_attention_backward phase: the backward's last attention, eager and math attention only.

    The first recording block's softmax backward (`first`: block_ends.end_blocks' first), with every gradient
    written but the input embeddings' (`grads`, less phases._late_grad_bytes) and the block's q/k/v projections'
    (block_ends.attention_pending_grad_bytes), what the embeddings saved (`embeds`), the block's checkpoint input
    and recompute (or its saved activations) less what its backward freed before the softmax's
    (block_ends.attention_freed_bytes), the hidden-state gradients and the score-sized gradients.
    """
    scores = score_grad_bytes(ctx)
    if not scores or first is None:
        return {}
    a = ctx.spec.arch
    tokens = ctx.setup.batch_size * max(ctx.src_len, ctx.tgt_len)
    freed = block_ends.attention_freed_bytes(ctx, first)
    work = 2 * tokens * a.hidden_size * ctx.residual_bytes + scores
    if ctx.setup.grad_ckpt:
        saved, work = embeds + first.checkpointed, work + first.recompute - freed
    else:
        saved = embeds + first.full - freed
    return {"first_attention_backward": {
        **res, "gradients": grads - block_ends.attention_pending_grad_bytes(ctx, first),
        "activations": int(saved), "attention_mask": checkpointed_mask_bytes(ctx), "dequant_temporaries": deq,
        "backward_temporaries": int(work)}}


def indexer_backward_phase(ctx: Ctx, grads: int, ends, embeds: int, in_blocks: int, back: dict) -> dict:
    """The backward_indexer phase: a checkpointed block's recompute runs DeepSeek-V3.2's indexer again.

    The indexer (forward_block.indexer_bytes) runs beside the residual stream's gradient from above and its input's. The
    larger of the last block's (the first the backward reaches: every checkpoint input still held, `in_blocks`, the
    head's gradients or the accumulated ones in `back`) and the first recording block's (`ends`' first: every gradient
    written, `grads` less phases._late_grad_bytes, but that block's own, block_ends.block_grad_bytes, beside the
    embeddings' saves `embeds` and its checkpoint input).
    """
    work = forward_block.indexer_bytes(ctx)
    if not (ctx.setup.grad_ckpt and work and ends):
        return {}
    a = ctx.spec.arch
    tokens = ctx.setup.batch_size * max(ctx.src_len, ctx.tgt_len)
    work += 2 * tokens * a.hidden_size * ctx.residual_bytes
    first = ends[0]
    last = {**back, "gradients": back["gradients"] or lg.head_grad_bytes(ctx), "activations": in_blocks,
            "backward_temporaries": work}
    early = {**back, "gradients": grads - block_ends.block_grad_bytes(ctx, first),
             "activations": int(embeds + first.checkpointed), "backward_temporaries": work}
    return {"backward_indexer": largest(last, early)}


def encoder_backward_phase(ctx: Ctx, res: dict, grads: int, held: int, sizes: list, embeds: int, back: dict,
                           temps: int) -> dict:
    """The encoder_backward phase of encoder-decoders: the backward of the encoder's last block.

    That is the first encoder block the backward reaches. The decoder's gradients are written and the encoder's not yet
    (unless they accumulate: `held`); the decoder's saves are freed, and every encoder block's (with checkpointing their
    inputs) and the embeddings' (`embeds`) are alive beside that block's own work: the larger of its MLP product's
    backward (its recompute less what the MLP output projection saved, and the working gradients `temps`:
    phases._backward_temp_bytes) and, with eager or math attention, its softmax's backward (its recompute less what its
    backward freed before, block_ends.attention_freed_bytes, the hidden-state gradients and the [b, heads, s, s] score
    gradients over the source). The step's other phases take the encoder's largest work beside the decoder's activations
    with no gradient written (backward_start), or its first block with every gradient written. sizes:
    activations.per_block_bytes.
    """

    last = block_ends.stack_last(ctx, sizes, "encoder") if ctx.spec.arch.kind == "seq2seq" else None
    if last is None:
        return {}
    ckpt = ctx.setup.grad_ckpt
    saved = embeds + sum(ck if ckpt else full for (full, ck), blk in zip(sizes, blocks(ctx.spec))
                         if blk.stack == "encoder")
    at = {**res, **back, "gradients": grads if held else grads - weights.stack_trainable_bytes(ctx).get("encoder", 0),
          # the recomputed block's autocast copies (the head's are freed), or every encoder block's kept from forward
          "autocast_weight_copies": back["autocast_weight_copies"] - quant.outside_cast_bytes(ctx) if ckpt
          else quant.autocast_copy_bytes(ctx, stack="encoder")}
    own = last.recompute if ckpt else 0.0  # without checkpointing its saves are in `saved`
    moments = [{**at, "activations": int(saved - (0 if ckpt else last.mlp_out)),
                "backward_temporaries": int(own - (last.mlp_out if ckpt else 0) + temps)}]
    scores = score_grad_bytes(ctx, ctx.src_len, ctx.src_len)
    if scores:
        freed = block_ends.attention_freed_bytes(ctx, last)
        stream = 2 * last.tokens * ctx.spec.arch.hidden_size * ctx.residual_bytes
        moments.append({**at, "activations": int(saved - (0 if ckpt else freed)),
                        "backward_temporaries": int(own - (freed if ckpt else 0) + stream + scores)})
    return {"encoder_backward": largest(*moments)}
