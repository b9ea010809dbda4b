"""Logits and the cross-entropy loss: [tokens, vocab] tensors, dominant for 128k-256k vocabularies."""
from __future__ import annotations

from memplan.memory.context import Ctx, per_model
from memplan.memory.weights import numel


def _logit_tokens(ctx: Ctx) -> int:
    a = ctx.spec.arch
    if not a.has_lm_head:
        return 0
    return ctx.setup.batch_size * (ctx.tgt_len if a.kind == "seq2seq" else ctx.src_len)


#: LM heads that call torch CrossEntropyLoss on the logits as they are (transformers 5.23 BertForMaskedLM,
#: T5/MT5ForConditionalGeneration, BartForConditionalGeneration); every other family goes through
#: `self.loss_function` (loss/loss_utils.py ForCausalLMLoss), which first does `logits = logits.float()`.
PLAIN_CROSS_ENTROPY = {"bert", "t5", "mt5", "bart"}


def _logit_bytes(ctx: Ctx) -> int:
    """dtype of the lm_head output: the compute dtype (autocast or a 16-bit model; fp32 for fp32 models)."""
    return ctx.compute_bytes


def _loss_bytes(ctx: Ctx) -> int:
    """dtype of log_softmax inside cross-entropy: fp32 after the loss_function upcast, or under autocast (log_softmax
    and nll_loss are on autocast's fp32 list); the logits dtype for plain CrossEntropyLoss on a 16-bit model."""
    if ctx.mixed or ctx.spec.arch.model_type not in PLAIN_CROSS_ENTROPY:
        return 4
    return _logit_bytes(ctx)


def logits_forward_bytes(ctx: Ctx) -> int:
    """Peak of the loss computation in forward: logits + the upcast copy (if any) + log_softmax output.

    transformers/loss/loss_utils.py ForCausalLMLoss: `logits = logits.float()` (a copy unless already fp32), labels
    are shifted instead of logits (5.x), then F.cross_entropy = log_softmax (saves its output for backward) +
    nll_loss.
    """
    t, v, lb, loss = _logit_tokens(ctx), ctx.vocab, _logit_bytes(ctx), _loss_bytes(ctx)
    upcast = loss if loss != lb else 0
    return t * v * (lb + upcast + loss) + softcap_bytes(ctx)


def softcap_bytes(ctx: Ctx) -> int:
    """Gemma2's final-logit soft-capping, logits = cap * tanh(logits / cap) (modeling_gemma2.py
    Gemma2ForCausalLM.forward): tanh saves its [tokens, vocab] output in the logits dtype until the loss's backward
    reaches it, beside the loss buffers. Found by the tracer: gemma-2-2b LoRA -2.1%, QLoRA -4.0% before."""
    if not ctx.spec.arch.final_logit_softcap:
        return 0
    return _logit_tokens(ctx) * ctx.vocab * _logit_bytes(ctx)


def largest_block_bytes(ctx: Ctx) -> int:
    """The largest single tensor of a training step: one [tokens, vocab] buffer in the loss dtype (the upcast
    logits, log_softmax output or its gradient); 0 without an LM head or in inference."""
    return _logit_tokens(ctx) * ctx.vocab * _loss_bytes(ctx) if ctx.training else 0


def logits_saved_bytes(ctx: Ctx) -> int:
    """What the loss keeps for backward: the log_softmax output [tokens, vocab]."""
    return _logit_tokens(ctx) * ctx.vocab * _loss_bytes(ctx)


def logits_backward_bytes(ctx: Ctx) -> int:
    """Peak at the start of backward: saved log_softmax output + nll_loss grad + log_softmax grad, all
    [tokens, vocab] in the loss dtype (aten nll_loss_backward / _log_softmax_backward_data allocate full-size
    results), and the soft-capping's saved tanh output (softcap_bytes)."""
    return _logit_tokens(ctx) * ctx.vocab * 3 * _loss_bytes(ctx) + softcap_bytes(ctx)


def head_backward_bytes(ctx: Ctx) -> int:
    """Live in lm_head's backward (after the loss backward freed its fp32 buffers): the logits gradient in the
    lm_head output dtype and the head's input gradient [tokens, hidden]."""
    t = _logit_tokens(ctx)
    return t * ctx.vocab * _logit_bytes(ctx) + t * ctx.spec.arch.hidden_size * ctx.compute_bytes


@per_model()
def head_grad_bytes(ctx: Ctx) -> int:
    """The output embedding's weight gradient, allocated in lm_head's backward while the logits gradient is alive
    (tied heads: the shared embedding's gradient)."""
    tied = dict(ctx.spec.tied)
    for m in ctx.spec.linears:
        weight = m.name + ".weight"
        if m.is_output and (weight in ctx.trainable or tied.get(weight) in ctx.trainable):
            return m.in_features * ctx.vocab * ctx.weight_bytes  # the head as resized (added tokens)
    return 0


@per_model("grad_accum")
def tied_accumulation_bytes(ctx: Ctx) -> int:
    """A trainable tied embedding gets two gradient contributions: lm_head's weight grad (computed first and held
    by the autograd engine's input buffer) and the embedding's dense backward (at the very end). The engine sums
    them out of place (torch/csrc/autograd/input_buffer.cpp; seen as an aten::add allocation of [V, H] with
    torch.profiler on plain CPU autograd, and by the tracer), so both contributions and their sum are alive at once:
    two extra copies beyond the gradient itself; with accumulation the sum is then added into the held .grad
    (three extra)."""
    tied = dict(ctx.spec.tied)
    copies = 3 if ctx.setup.grad_accum > 1 else 2
    for m in ctx.spec.linears:
        target = tied.get(m.name + ".weight")
        if m.is_output and target in ctx.trainable:
            return copies * m.in_features * ctx.vocab * ctx.weight_bytes
    # encoder-decoders whose checkpoint keeps its own lm_head (flan-t5-xl, T0_3B, mt0-xxl): the shared embedding
    # still serves the encoder and the decoder, whose contributions the engine sums the same way (found by the
    # tracer: mt0-xxl full fine-tuning held 2 x [V, H] fp32 at the end of backward, -3.8% before)
    for p in ctx.spec.params:
        if p.role == "embedding" and p.name in ctx.trainable and list(tied.values()).count(p.name) >= 2:
            return copies * numel(ctx, p) * ctx.weight_bytes
    return 0


def inference_logits_bytes(ctx: Ctx) -> int:
    """generate(): the prefill computes logits for the last position only (logits_to_keep=1, transformers 5.x
    GenerationMixin) and copies them to fp32; encoders (no generation) compute all positions."""
    a = ctx.spec.arch
    b = ctx.setup.batch_size
    if not a.has_lm_head:
        return 0
    if a.kind == "encoder":
        # beside the logits: the encoder's last hidden state (held in the model's outputs) and, for heads with a
        # dense + norm transform (BERT's cls.predictions.transform), its output. Measured: bert-large bf16 b8 s512
        # inference held both (0.0078 GiB each) beside the 0.2329 GiB logits (benchmarks/diagnose/cases-3.yaml).
        hidden = 1 + _head_transform(ctx)
        return b * ctx.src_len * (ctx.vocab + hidden * a.hidden_size) * ctx.compute_bytes
    return b * ctx.vocab * (ctx.compute_bytes + 4)


def _head_transform(ctx: Ctx) -> bool:
    """A hidden x hidden Linear outside the blocks: an LM head with its own dense transform before the decoder."""
    h = ctx.spec.arch.hidden_size
    return any(p.block is None and p.role == "linear" and tuple(p.shape) == (h, h) for p in ctx.spec.params)
