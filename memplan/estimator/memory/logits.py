"""Logits and the cross-entropy loss: [tokens, vocab] tensors, dominant for 128k-256k vocabularies."""
from __future__ import annotations

from memplan import libs
from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory import fused_head, new_tokens
from memplan.estimator.memory.fused_head import trl_head
from memplan.estimator.memory.saves import liger_head
from memplan.estimator.memory.weights import numel, output_head


def _logit_tokens(ctx: Ctx) -> int:
    """Tokens the LM head computes logits for per micro-batch (the target length for seq2seq); 0 without a head."""
    a = ctx.spec.arch
    if not a.has_lm_head:
        return 0
    return ctx.setup.batch_size * (ctx.tgt_len if a.kind == "seq2seq" else ctx.src_len)


#: transformers 4.49 (loss/loss_utils.py ForCausalLMLoss) pads the labels instead of shifting the logits; from 4.46
#: to 4.48 the loss shifted them, `shift_logits = logits[..., :-1, :].contiguous()`: one more [tokens, vocab] copy
#: alive in the loss's forward.
LOGITS_UNSHIFTED_FROM = (4, 49)

#: Causal LMs that called torch CrossEntropyLoss on their own shifted copy of the logits before 4.49 (4.48.1
#: GPT2LMHeadModel, GPTBigCodeForCausalLM, FalconForCausalLM, BloomForCausalLM, OPTForCausalLM and
#: GPTNeoXForCausalLM.forward: `shift_logits = lm_logits[..., :-1, :].contiguous()`, no fp32 upcast); 4.49 moved
#: them to `self.loss_function`.
OWN_SHIFT_BEFORE_4_49 = {"gpt2", "gpt_bigcode", "falcon", "bloom", "opt", "gpt_neox"}


def _shifts_logits(ctx: Ctx) -> bool:
    """The loss copies the logits shifted by one position (transformers before 4.49, causal LM families).

    With one sequence the slice `[..., :-1, :]` of the contiguous [1, s, vocab] logits is already contiguous and
    `.contiguous()` returns it uncopied.
    """
    a = ctx.spec.arch
    return (a.kind != "seq2seq" and not a.plain_cross_entropy and ctx.setup.batch_size > 1
            and libs.older_than("transformers", LOGITS_UNSHIFTED_FROM))


def _plain_cross_entropy(ctx: Ctx) -> bool:
    """The family calls CrossEntropyLoss on the logits without the loss_function's fp32 upcast.

    Arch.plain_cross_entropy is read from the head's code: BERT-like encoders, T5, BART and their copies. Every
    other family goes through `self.loss_function` (loss/loss_utils.py), which first does `logits = logits.float()`,
    except those that shifted their own logits before transformers 4.49 (OWN_SHIFT_BEFORE_4_49).
    """
    a = ctx.spec.arch
    return a.plain_cross_entropy or (a.model_type in OWN_SHIFT_BEFORE_4_49 and _shifts_logits(ctx))


def _flce_chunk(ctx: Ctx) -> int:
    """Rows per chunk: next_pow2(ceil(BT / ceil(V / H))), at most BT (ops/fused_linear_cross_entropy.py)."""
    bt, v, h = _logit_tokens(ctx), ctx.vocab, ctx.spec.arch.hidden_size
    rows = -(-bt // -(-v // h))
    return min(1 << max(0, rows - 1).bit_length(), bt)


def _flce_saved(ctx: Ctx) -> int:
    """What the fused loss keeps from its forward to its backward: grad_input [BT, H] in the hidden states' dtype
    and, when the head trains, grad_weight [V, H] in the weight's dtype (it becomes lm_head.weight.grad)."""
    return _logit_tokens(ctx) * ctx.spec.arch.hidden_size * ctx.residual_bytes + head_grad_bytes(ctx)


def _flce_forward(ctx: Ctx) -> int:
    """The fused loss at its largest moment, a chunk: the saved buffers, the [C, V] logits block (the matmul's dtype),
    the [C, H] slice of grad_input, the fp32 loss and the mask per token, and for a 16-bit grad_weight the [V, H] mm
    result and its fp32 copy (`grad_weight += torch.mm(...).float()`; an fp32 one accumulates in place). Under
    autocast over fp32 weights each chunk's `x @ weight.t()` casts the transposed view to the compute dtype anew
    (a view is no leaf: autocast caches only leaves that require grad), and `logits @ weight` casts the weight
    itself: cached for the whole forward when it trains, made anew per chunk when frozen."""
    c, v, h, lb = _flce_chunk(ctx), ctx.vocab, ctx.spec.arch.hidden_size, _logit_bytes(ctx)
    work = c * v * lb + c * h * lb + _logit_tokens(ctx) * 5
    grads = head_grad_bytes(ctx)
    if grads and ctx.weight_bytes < 4:
        work += v * h * (lb + 4)
    if ctx.mixed and ctx.weight_bytes != lb:
        work += v * h * lb * (2 if grads else 1)
    return _flce_saved(ctx) + work


def _logit_bytes(ctx: Ctx) -> int:
    """Bytes per element of the lm_head output: the compute dtype (autocast or a 16-bit model; fp32 for fp32 models)."""
    return ctx.compute_bytes


def _fp32_logits(ctx: Ctx) -> bool:
    """The logits the loss reads are fp32 because the head adds an fp32 bias buffer to them.

    BART, mBART, Marian, Pegasus and their copies compute `lm_logits + self.final_logits_bias`. The buffer has the
    dtype the model was loaded in (Buffer "float"): fp32 under mixed precision, 16-bit under QLoRA (k-bit
    preparation casts parameters only); FSDP's 16-bit parameter policy leaves buffers fp32 too (Ctx.autocast_16bit).
    Added tokens make it fp32 whatever the model's dtype: resize_token_embeddings grows it with
    `torch.zeros((1, extra))`, fp32 by default, and torch.cat promotes (modeling_bart `_resize_final_logits_bias`).
    """
    has_bias = any(b.name.endswith("final_logits_bias") and b.dtype == "float" for b in ctx.spec.buffers)
    return has_bias and ((ctx.mixed and ctx.setup.weight_dtype == "fp32") or ctx.autocast_16bit
                         or ctx.setup.added_tokens > 0)


def _cuda_split_loss(ctx: Ctx) -> bool:
    """Plain CrossEntropyLoss on 16-bit logits under CUDA autocast: a 16-bit log_softmax plus nll_loss's fp32 cast.

    CUDA autocast has no entry for cross_entropy_loss, so aten's decomposition runs (LossNLL.cpp:
    `log_softmax(self, class_dim, self.scalar_type())`): the fp32_set_opt_dtype policy respects that dtype, a 16-bit
    log_softmax is saved, and nll_loss (on autocast's fp32 list) casts it to fp32, which its backward saves too.
    CPU autocast differs: it casts the logits to fp32 first (emulate_autocast._cuda_cross_entropy runs CUDA's order).
    """
    return ctx.autocast and _plain_cross_entropy(ctx) and _logit_bytes(ctx) < 4 and not _fp32_logits(ctx)


def _loss_bytes(ctx: Ctx) -> int:
    """Bytes per element of log_softmax inside cross-entropy.

    fp32 after the loss_function upcast, or under autocast (log_softmax and nll_loss are on autocast's fp32 list);
    the logits dtype for plain CrossEntropyLoss on a 16-bit model, fp32 where an fp32 bias makes them so
    (_fp32_logits).
    """
    if ctx.autocast or not _plain_cross_entropy(ctx) or _fp32_logits(ctx):
        return 4
    return _logit_bytes(ctx)


def logits_forward_bytes(ctx: Ctx) -> int:
    """Peak of the loss computation in forward.

    Logits + the upcast copy (if any) + log_softmax output, and before transformers 4.49 the shifted copy of the
    logits (_shifts_logits).

    transformers/loss/loss_utils.py ForCausalLMLoss: `logits = logits.float()` (a copy unless already fp32), labels
    are shifted instead of logits (4.49 on), then F.cross_entropy = log_softmax (saves its output for backward) +
    nll_loss. The families that shifted their logits themselves before 4.49 (OWN_SHIFT_BEFORE_4_49) copied them in
    the logits dtype and cast only under autocast (log_softmax is on its fp32 list): there the fp32 input copy is
    alive while log_softmax writes its output.
    """
    if liger_head(ctx):
        return _flce_forward(ctx)
    if trl_head(ctx):
        return fused_head.forward_bytes(ctx)
    t, v, lb, loss = _logit_tokens(ctx), ctx.vocab, _logit_bytes(ctx), _loss_bytes(ctx)
    if _fp32_logits(ctx):  # the 16-bit head output is gone once the biased fp32 sum exists
        lb = 4
    upcast = loss if loss != lb else 0
    shifted = 0
    if _shifts_logits(ctx):
        shifted = lb if ctx.spec.arch.model_type in OWN_SHIFT_BEFORE_4_49 else loss
    head = t * v * lb + new_tokens.head_forward_bytes(ctx)  # the head's matmul, before the loss
    if _cuda_split_loss(ctx):  # logits, 16-bit log-probabilities, their fp32 cast for nll_loss
        return max(head, t * v * (lb + shifted + lb + 4) + softcap_bytes(ctx))
    return max(head, t * v * (lb + upcast + shifted + loss) + softcap_bytes(ctx))


def softcap_bytes(ctx: Ctx) -> int:
    """Gemma2's final-logit soft-capping, logits = cap * tanh(logits / cap): tanh's saved output.

    tanh saves its [tokens, vocab] output in the logits dtype until the loss's backward reaches it, beside the loss
    buffers. Source: modeling_gemma2.py Gemma2ForCausalLM.forward.
    """
    if not ctx.spec.arch.final_logit_softcap or liger_head(ctx) or trl_head(ctx):  # the fused heads cap per tile
        return 0
    return _logit_tokens(ctx) * ctx.vocab * _logit_bytes(ctx)


def largest_block_bytes(ctx: Ctx) -> int:
    """The largest single tensor of a training step; 0 without an LM head or in inference.

    One [tokens, vocab] buffer in the loss dtype: the upcast logits, log_softmax output or its gradient.
    """
    if trl_head(ctx):
        return fused_head.largest_block_bytes(ctx)
    if liger_head(ctx):
        v, h = ctx.vocab, ctx.spec.arch.hidden_size
        temp = v * h * 4 if head_grad_bytes(ctx) and ctx.weight_bytes < 4 else 0
        return max(_flce_chunk(ctx) * v * _logit_bytes(ctx), temp, head_grad_bytes(ctx),
                   _logit_tokens(ctx) * h * ctx.residual_bytes)
    return _logit_tokens(ctx) * ctx.vocab * _loss_bytes(ctx) if ctx.training else 0


def logits_saved_bytes(ctx: Ctx) -> int:
    """What the loss keeps for backward: the log_softmax output [tokens, vocab].

    Under _cuda_split_loss also nll_loss's fp32 cast of it.
    """
    if liger_head(ctx):
        return _flce_saved(ctx)
    if trl_head(ctx):
        return fused_head.saved_bytes(ctx)
    if _cuda_split_loss(ctx):
        return _logit_tokens(ctx) * ctx.vocab * (_logit_bytes(ctx) + 4)
    return _logit_tokens(ctx) * ctx.vocab * _loss_bytes(ctx)


def logits_backward_bytes(ctx: Ctx) -> int:
    """Peak at the start of backward, in the loss.

    Saved log_softmax output + nll_loss grad + log_softmax grad, all [tokens, vocab] in the loss dtype (aten
    nll_loss_backward / _log_softmax_backward_data allocate full-size results), and the soft-capping's saved tanh
    output (softcap_bytes). Under _cuda_split_loss: the 16-bit log_softmax output and nll_loss's saved fp32 cast
    beside its fp32 gradient (the engine frees the cast once nll_loss's backward has run, before the gradient's
    cast back and log_softmax's backward).
    """
    if liger_head(ctx):  # its backward scales the saved gradients in place
        return _flce_saved(ctx)
    if trl_head(ctx):
        return fused_head.backward_bytes(ctx)
    if _cuda_split_loss(ctx):
        return _logit_tokens(ctx) * ctx.vocab * (_logit_bytes(ctx) + 4 + 4) + softcap_bytes(ctx)
    return _logit_tokens(ctx) * ctx.vocab * 3 * _loss_bytes(ctx) + softcap_bytes(ctx)


def head_backward_bytes(ctx: Ctx) -> int:
    """Live in lm_head's backward, after the loss backward freed its fp32 buffers.

    The logits gradient in the lm_head output dtype and the head's input gradient [tokens, hidden].
    """
    t = _logit_tokens(ctx)
    if liger_head(ctx):  # grad_input is the hidden states' gradient; grad_weight is already the head's .grad
        return t * ctx.spec.arch.hidden_size * ctx.residual_bytes
    if trl_head(ctx):
        return fused_head.scatter_backward_bytes(ctx)
    return t * ctx.vocab * _logit_bytes(ctx) + t * ctx.spec.arch.hidden_size * ctx.compute_bytes


@per_model()
def head_grad_bytes(ctx: Ctx) -> int:
    """The output embedding's weight gradient, allocated in lm_head's backward while the logits gradient is alive
    (tied heads: the shared embedding's gradient)."""
    head = output_head(ctx)
    if head is not None:
        return head.in_features * ctx.vocab * ctx.weight_bytes  # the head as resized (added tokens)
    return new_tokens.head_grad_bytes(ctx)


def tied_accumulation_bytes(ctx: Ctx) -> int:
    """Extra gradient copies a trainable tied embedding holds while its two contributions are summed.

    The contributions are lm_head's weight grad (computed first and held by the autograd engine's input buffer) and
    the embedding's dense backward (at the very end). The engine sums them out of place
    (torch/csrc/autograd/input_buffer.cpp), so both and their sum are alive at once: two extra copies beyond the
    gradient itself; with accumulation the sum is then added into the held .grad (three extra).
    Liger's fused loss hands over its own grad_weight buffer, which nothing else holds once its node is released:
    the engine adds the embedding's contribution into it in place (input_buffer.cpp accumulate: "If we hold the
    last reference to `old_var` AND its storage we will try to repurpose it"), one extra. Measured on an H100
    (Llama-3.2-1B full bf16-mixed with Liger: 0.98 GiB, one fp32 table, below the out-of-place sum) and on real CPU
    tensors; the tracer's Liger stand-in hands the buffer over as .grad, since autograd never accumulates into a fake
    tensor (a tensor subclass) in place.
    """
    extra = 1 if liger_head(ctx) or trl_head(ctx) else 2
    return (extra + 1 if ctx.setup.grad_accum > 1 else extra) * tied_table_bytes(ctx)


@per_model()
def tied_table_bytes(ctx: Ctx) -> int:
    """One gradient of the trainable table two uses share (tied_accumulation_bytes); 0 without one.

    The input embedding lm_head is tied to, or, in encoder-decoders whose checkpoint keeps its own lm_head
    (flan-t5-xl, T0_3B, mt0-xxl), the shared embedding the encoder and the decoder both read, whose contributions
    the engine sums the same way.
    """
    tied = dict(ctx.spec.tied)
    for m in ctx.spec.linears:
        target = tied.get(m.name + ".weight")
        if m.is_output and target in ctx.trainable:
            return m.in_features * ctx.vocab * ctx.weight_bytes
    for p in ctx.spec.params:
        if p.role == "embedding" and p.name in ctx.trainable and list(tied.values()).count(p.name) >= 2:
            return numel(ctx, p) * ctx.weight_bytes
    return 0


def inference_logits_bytes(ctx: Ctx) -> int:
    """Logits bytes at inference.

    generate()'s prefill computes logits for the last position only (logits_to_keep=1, transformers 5.x
    GenerationMixin) and copies them to fp32; encoders (no generation) compute all positions.
    """
    a = ctx.spec.arch
    b = ctx.setup.batch_size
    if not a.has_lm_head:
        return 0
    if a.kind == "encoder":
        # beside the logits: the encoder's last hidden state (held in the model's outputs) and, for heads with a
        # dense + norm transform (BERT's cls.predictions.transform), its output.
        # Measured: benchmarks/diagnose/cases-3.yaml (bert-large).
        hidden = 1 + _head_transform(ctx)
        return b * ctx.src_len * (ctx.vocab + hidden * a.hidden_size) * ctx.compute_bytes
    return b * ctx.vocab * (ctx.compute_bytes + 4)


def _head_transform(ctx: Ctx) -> bool:
    """A hidden x hidden Linear outside the blocks: an LM head with its own dense transform before the decoder."""
    h = ctx.spec.arch.hidden_size
    return any(p.block is None and p.role == "linear" and tuple(p.shape) == (h, h) for p in ctx.spec.params)
