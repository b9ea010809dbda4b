"""TRL's fused LM head: per-token log-probabilities in [4096 x 32768] tiles, never the [tokens, vocab] logits.

TRL 1.16's SFTTrainer, DPOTrainer and GRPOTrainer patch the model with add_fused_lm_head (trl/trainer/utils.py) and
call it with fused_lm_head=True: the backbone runs, `last_hidden_state[:, :-1]` is compacted to the positions whose
label is not -100 (`hidden_states[mask]`, a [N, H] copy, on CUDA), and _ChunkedLogProbFunction
(trl/kernels/chunked_logprob.py) projects it tile by tile into one `mm_buf` of [min(N, 4096), 32768] in the compute
dtype, folding each tile into fp32 per-token statistics. Its backward recomputes the tiles into a second `mm_buf`,
accumulating an fp32 grad_hidden [N, H] and, when the head trains, an fp32 grad_weight [V, H], cast back to the
inputs' dtypes before it returns.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.weights import output_head
from memplan.setup import TRL_TRAINERS

#: tokens per projection tile (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE)
TOKEN_CHUNK = 4096
#: vocabulary columns per tile (trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE)
VOCAB_CHUNK = 32768
#: fp32 [N] vectors the forward keeps while it folds the tiles (running_max, sum_exp, x_sum_exp, sq_sum_exp, z_sum,
#: max_before_target, target_logit)
FOLD_VECTORS = 7


def trl_head(ctx: Ctx) -> bool:
    """A TRL trainer scores the tokens through the fused head (a causal LM with an LM head, training)."""
    a = ctx.spec.arch
    return ctx.training and ctx.setup.trainer in TRL_TRAINERS and a.kind == "causal" and a.has_lm_head


def rows(ctx: Ctx) -> int:
    """Sequences in the head's input: the micro-batch, or one packed row (padding_free)."""
    return ctx.setup.batch_size


def scored_tokens(ctx: Ctx) -> int:
    """N, the positions with a label after the shift: a row's tokens but the first (sft; padding-free masks each
    document's first token instead), its completion (dpo: the tokens past --prompt-len; grpo: max_completion_length,
    labels[:, :-logits_to_keep] = -100 in grpo_trainer.py)."""
    s = ctx.setup
    if s.trainer == "grpo":
        return s.batch_size * s.max_completion_length
    if s.trainer == "dpo" and s.prompt_len:
        return s.batch_size * max(ctx.src_len - s.prompt_len, 1)
    return s.batch_size * (ctx.src_len - 1)


def _outputs(ctx: Ctx) -> int:
    """fp32 per-token outputs besides log_probs: entropy (sft, grpo's policy), entropy and mean_logits (dpo)."""
    return {"sft": 1, "dpo": 2, "grpo": 1}[ctx.setup.trainer]


def _head_trains(ctx: Ctx) -> bool:
    return output_head(ctx) is not None


def saved_bytes(ctx: Ctx) -> int:
    """What the head keeps for its backward: the compacted hidden states [N, H], the two int64 index vectors of the
    boolean indexing and the int64 targets, log_z and entropy [N] fp32; and its [rows, S-1] outputs scattered back
    (fp32 each, a bool is_top1 and the label mask)."""
    n, h = scored_tokens(ctx), ctx.spec.arch.hidden_size
    per_row = rows(ctx) * (ctx.src_len - 1)
    return n * h * ctx.residual_bytes + n * (3 * 8 + 2 * 4) + per_row * (4 * (1 + _outputs(ctx)) + 2)


def _vocab_chunks(ctx: Ctx) -> list[int]:
    """The weight's rows per tile, in the order one token chunk visits them."""
    v = ctx.vocab
    return [min(VOCAB_CHUNK, v - start) for start in range(0, v, VOCAB_CHUNK)]


def _cast_bytes(ctx: Ctx, backward: bool) -> int:
    """The casts to the compute dtype alive with a tile. The forward casts each weight chunk inside the matmul's
    statement (one at a time) and binds the token chunk to `hidden_chunk`; the backward binds both (`w_chunk`), so
    the next is made before the previous is released: the largest two consecutive chunks, the visit order repeating
    for each token chunk. A cast to the dtype a tensor already has makes nothing."""
    n, h, c = scored_tokens(ctx), ctx.spec.arch.hidden_size, ctx.compute_bytes
    token_chunks = -(-n // TOKEN_CHUNK)
    tokens = min(n, TOKEN_CHUNK) * (2 if token_chunks > 1 else 1)
    hidden = tokens * h * c if ctx.residual_bytes != c else 0
    if ctx.weight_bytes == c:
        return hidden
    chunks = _vocab_chunks(ctx) * token_chunks
    if not chunks:  # nothing scored (a one-token row)
        return 0
    if not backward or len(chunks) == 1:
        return hidden + max(chunks) * h * c
    return hidden + max(a + b for a, b in zip(chunks, chunks[1:])) * h * c


def _tile_bytes(ctx: Ctx, backward: bool = False) -> int:
    """One mm_buf of [min(N, 4096), min(V, 32768)] in the compute dtype, with the casts alive beside it."""
    n, c = scored_tokens(ctx), ctx.compute_bytes
    return min(n, TOKEN_CHUNK) * min(ctx.vocab, VOCAB_CHUNK) * c + _cast_bytes(ctx, backward)


def forward_bytes(ctx: Ctx) -> int:
    """The head at its forward's largest moment: what it saves, the last hidden state it reads [rows, S, H], a tile
    and its casts, and the fp32 fold vectors."""
    h = ctx.spec.arch.hidden_size
    last = rows(ctx) * ctx.src_len * h * ctx.residual_bytes
    return saved_bytes(ctx) + last + _tile_bytes(ctx) + FOLD_VECTORS * 4 * scored_tokens(ctx)


def reference_bytes(ctx: Ctx) -> int:
    """A no-grad scoring pass (DPO's reference, GRPO's reference log-probs): the forward's moment without what only
    a backward needs kept - log_probs alone."""
    n, h = scored_tokens(ctx), ctx.spec.arch.hidden_size
    last = rows(ctx) * ctx.src_len * h * ctx.residual_bytes
    return n * h * ctx.residual_bytes + last + _tile_bytes(ctx) + (FOLD_VECTORS + 2) * 4 * n + n * 3 * 8


def backward_bytes(ctx: Ctx) -> int:
    """The head's backward before it returns: what the forward saved, fp32 grad_hidden and (head trains) fp32
    grad_weight, a tile with its casts, and the casts back to the inputs' dtypes (`grad_hidden.to(hidden.dtype)`,
    `grad_weight.to(weight.dtype)`), all locals alive until the return."""
    n, h, v = scored_tokens(ctx), ctx.spec.arch.hidden_size, ctx.vocab
    grad_hidden = n * h * (4 + (ctx.residual_bytes if ctx.residual_bytes != 4 else 0))
    grad_weight = v * h * (4 + (ctx.weight_bytes if ctx.weight_bytes != 4 else 0)) if _head_trains(ctx) else 0
    return saved_bytes(ctx) + grad_hidden + grad_weight + _tile_bytes(ctx, backward=True)


def scatter_backward_bytes(ctx: Ctx) -> int:
    """After the head: its input gradient [N, H] scattered back by the indexing's backward into zeros
    [rows, S-1, H], then by the slice's into zeros [rows, S, H], in the hidden states' dtype."""
    h, r = ctx.spec.arch.hidden_size, ctx.residual_bytes
    return (scored_tokens(ctx) + rows(ctx) * (2 * ctx.src_len - 1)) * h * r


def largest_block_bytes(ctx: Ctx) -> int:
    """The head's largest single tensor: a tile, the fp32 grad_weight or grad_hidden, the last hidden state."""
    n, h = scored_tokens(ctx), ctx.spec.arch.hidden_size
    return max(min(n, TOKEN_CHUNK) * min(ctx.vocab, VOCAB_CHUNK) * ctx.compute_bytes,
               ctx.vocab * h * 4 if _head_trains(ctx) else 0, n * h * 4,
               rows(ctx) * ctx.src_len * h * ctx.residual_bytes)
