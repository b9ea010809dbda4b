"""Training added tokens under LoRA (Setup.train_new_tokens): what peft's two mechanisms hold (peft 0.21).

- modules-to-save (LoraConfig(modules_to_save=[embedding, head])): ModulesToSaveWrapper deep-copies each module and
  trains the copy in the base dtype while the original stays frozen (peft utils/other.py ModulesToSaveWrapper), so
  two more [vocab, hidden] tables are resident and both train: their gradients and optimizer state. A tied head's
  copy is its own tensor (the copies break the tying: peft's default ensure_weight_tying=False). The head's copy
  saves its input for its weight gradient.
- token-indices (LoraConfig(trainable_token_indices=...)): TrainableTokensLayer keeps the new rows' values and
  originals, [n, hidden] fp32 each (cast_adapter_dtype), per wrapped table (the embedding; an untied head listed
  too; a tied head shares the embedding's). Every forward merges them into the table out of place
  (`W.index_copy(0, idx, delta)`): the head's merged [vocab, hidden] table is saved for its backward. Under autocast
  (and QLoRA's fp32 table) the matmul saves the table's compute-dtype cast instead, as the plain head saves its
  weight's cast (quant.outside_cast_bytes), so nothing more is saved; the merged fp32 table lives only while the
  head's matmul runs (the merged table is no leaf, so autocast does not cache it). Traced at full depth and measured
  on an H100 (Llama-3.2-1B QLoRA, 3 tokens: 5.57 GiB traced, 5.566 measured).
Traced on GPT-2, Qwen2.5-0.5B (tied) and Mistral-7B (untied): benchmarks/matrices/trace_vs_estimate.yaml.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx


def _table(ctx: Ctx) -> tuple[int, int]:
    """(vocab as resized, hidden) of the embedding table."""
    return ctx.vocab, ctx.spec.arch.hidden_size


def _trains_new_tokens(ctx: Ctx) -> str | None:
    return ctx.setup.train_new_tokens if ctx.training and ctx.setup.uses_lora else None


def _tied(ctx: Ctx) -> bool:
    return any(p.role == "embedding" for p in ctx.spec.params) and bool(ctx.spec.tied)


def extra_weight_bytes(ctx: Ctx) -> int:
    """Resident bytes the mechanism adds beside the model's own tables."""
    mode = _trains_new_tokens(ctx)
    v, h = _table(ctx)
    if mode == "modules-to-save":
        return 2 * v * h * ctx.weight_bytes
    if mode == "token-indices":
        return 2 * ctx.setup.added_tokens * h * 4 * (1 if _tied(ctx) else 2)
    return 0


def extra_trainable(ctx: Ctx) -> list[tuple[tuple[int, int], int, bool]]:
    """The tensors the mechanism trains: (shape, bytes per element, is an nn.Embedding weight)."""
    mode = _trains_new_tokens(ctx)
    v, h = _table(ctx)
    if mode == "modules-to-save":
        return [((v, h), ctx.weight_bytes, True), ((v, h), ctx.weight_bytes, False)]
    if mode == "token-indices":
        return [((ctx.setup.added_tokens, h), 4, False)] * (1 if _tied(ctx) else 2)
    return []


def head_saved_bytes(ctx: Ctx, tokens: int) -> int:
    """What the head saves for backward beyond the plain LoRA step: the trainable copy's input [tokens, hidden]
    (modules-to-save) or the merged [vocab, hidden] table (token-indices)."""
    mode = _trains_new_tokens(ctx)
    v, h = _table(ctx)
    if mode == "modules-to-save":
        return tokens * h * ctx.act_bytes
    if mode == "token-indices":  # under autocast the cast is saved, as the plain head's is: nothing more
        return 0 if ctx.mixed else v * h * ctx.weight_bytes
    return 0


def head_forward_bytes(ctx: Ctx) -> int:
    """The merged table alive beside its cast while the head's matmul runs (token-indices under autocast)."""
    v, h = _table(ctx)
    return v * h * ctx.weight_bytes if _trains_new_tokens(ctx) == "token-indices" and ctx.mixed else 0


def head_grad_bytes(ctx: Ctx) -> int:
    """The head's weight gradient as its backward makes it: the copy's (modules-to-save) or the merged table's,
    dense, before peft picks the new rows (token-indices)."""
    v, h = _table(ctx)
    mode = _trains_new_tokens(ctx)
    if mode == "token-indices" and ctx.mixed:  # the cast's gradient first (its fp32 copy once the logits' is gone)
        return v * h * ctx.compute_bytes
    return v * h * ctx.weight_bytes if mode else 0
