"""Logits and the cross-entropy loss: [tokens, vocab] tensors, dominant for 128k-256k vocabularies."""
from __future__ import annotations

from memplan.memory.context import Ctx


def _logit_tokens(ctx: Ctx) -> int:
    a = ctx.spec.arch
    if not a.has_lm_head:
        return 0
    return ctx.setup.batch_size * (ctx.tgt_len if a.kind == "seq2seq" else ctx.src_len)


def _logit_bytes(ctx: Ctx) -> int:
    """dtype of the lm_head output: the compute dtype (autocast / 16-bit model), fp32 for fp32 and kbit-prepared
    models without autocast."""
    return ctx.compute_bytes


def logits_forward_bytes(ctx: Ctx) -> int:
    """Peak of the loss computation in forward: logits + fp32 upcast + log_softmax output.

    transformers/loss/loss_utils.py ForCausalLMLoss / ForMaskedLMLoss: `logits = logits.float()` (a copy unless
    already fp32), labels are shifted instead of logits (5.x), then F.cross_entropy = log_softmax (saves its fp32
    output for backward) + nll_loss.
    """
    t, v, lb = _logit_tokens(ctx), ctx.vocab, _logit_bytes(ctx)
    upcast = 4 if lb != 4 else 0
    return t * v * (lb + upcast + 4)


def logits_saved_bytes(ctx: Ctx) -> int:
    """What the loss keeps for backward: the fp32 log_softmax output [tokens, vocab]."""
    return _logit_tokens(ctx) * ctx.vocab * 4


def logits_backward_bytes(ctx: Ctx) -> int:
    """Peak at the start of backward: saved log_softmax output + nll_loss grad + log_softmax grad, all fp32
    [tokens, vocab] (aten nll_loss_backward / _log_softmax_backward_data allocate full-size results)."""
    return _logit_tokens(ctx) * ctx.vocab * 12


def inference_logits_bytes(ctx: Ctx) -> int:
    """generate(): the prefill computes logits for the last position only (logits_to_keep=1, transformers 5.x
    GenerationMixin) and copies them to fp32; encoders (no generation) compute all positions."""
    a = ctx.spec.arch
    b = ctx.setup.batch_size
    if not a.has_lm_head:
        return 0
    if a.kind == "encoder":
        return b * ctx.src_len * ctx.vocab * ctx.compute_bytes
    return b * ctx.vocab * (ctx.compute_bytes + 4)
