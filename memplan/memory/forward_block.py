"""The forward's own peak inside a checkpointed block: under torch.utils.checkpoint (non-reentrant, transformers'
default: modeling_utils gradient_checkpointing_enable) the block's forward saves nothing (the pack hook drops every
saved tensor), so each tensor is freed once it is unused, but an eager (or math-kernel) attention holds
several [b, heads, s, s] tensors at once while its softmax runs. With every block's checkpoint input alive by the
last block, that moment can top the backward's phases where the attention's code keeps more score-sized tensors
named than the backward holds: Falcon (its raw scores beside the masked sum and the probabilities, and the previous
layer's probabilities, which its layer returns to the model's loop), BLOOM. Found by the tracer: falcon-7b QLoRA
eager b8 s1024 checkpointed, -5.7% with no in-forward moment (its peak was at the second block's softmax)."""
from __future__ import annotations

from memplan.memory.attention import QK_FP32, attention_kernel, heads_broadcast, kernel_bytes, softmax_out_bytes
from memplan.memory.context import Ctx


def score_moment_bytes(ctx: Ctx, kernel: str) -> int:
    """Bytes per [b, heads, q, k] element alive at once inside one checkpointed attention's forward (the largest of
    its moments), for the eager code as the family writes it (Arch.eager_held, attnfacts.eager_held) and aten's math
    kernel (_scaled_dot_product_attention_math: fp32 scores, the mask added in place, the softmax a new tensor).

    Eager, per element: the scores (kb: the matmul's dtype, fp32 for QK_FP32 families outside autocast) scaled into a
    new tensor (2 kb); the masked sum (pb: promoted to the additive mask's dtype, the residual stream's,
    masking_utils); the softmax output (sb, attention.softmax_out_bytes) beside the sum and, where softmax converts a
    16-bit input to fp32 first (aten SoftMax.cpp softmax: only CUDA Half to Float skips the copy), that copy; the
    cast back to q's dtype beside both; with attention dropout the probabilities, the dropped copy and native_dropout's
    bool mask; PV's matmul, under autocast with a compute-dtype copy of fp32 probabilities. Falcon's raw scores stay named through the softmax, BLOOM's scores and sum to the end; a layer that
    returns its probabilities (Arch.returns_attn_probs) keeps the previous layer's alive through the whole moment."""
    a = ctx.spec.arch
    drop = a.attn_dropout > 0
    if kernel == "math":
        return 4 + 4 + (1 if drop else 0)
    if kernel != "eager":
        return 0
    held_scores, held_sum, cast_back = (tuple(a.eager_held) + (False, False, True))[:3]
    c = kernel_bytes(ctx)
    kb = 4 if a.model_type in QK_FP32 and not ctx.mixed else c
    pb = max(kb, ctx.residual_bytes)
    sb = softmax_out_bytes(ctx, kernel)
    converts = sb == 4 and pb < 4 and "fp16" not in ctx.setup.precision
    cast = ctx.act_bytes if cast_back and ctx.act_bytes != sb else 0
    probs = cast or sb
    scores = kb if held_scores else 0
    moments = [2 * kb, kb + pb, pb + (4 if converts else 0) + sb + scores]
    if cast:
        moments.append(pb + sb + cast + scores)
    kept = (pb + scores) if held_sum else 0
    if drop:
        moments.append(2 * probs + 1 + kept)
    # PV's matmul: under autocast a compute-dtype copy of fp32 probabilities (BLOOM's bmm beside its scores and sum)
    moments.append(probs + (c if ctx.mixed and probs != c else 0) + kept)
    return max(moments) + (probs if a.returns_attn_probs else 0)


def working_bytes(ctx: Ctx) -> int:
    """What one checkpointed block holds at its attention's softmax in the forward, besides its checkpoint input
    (counted with the activations): the normed input (residual dtype), q, k and v as the projections return them
    (act_bytes; a fused projection's whole output, which its views keep, plus rotated q and k), K and V repeated to
    every head for an eager attention over grouped K/V (transformers repeat_kv), the math kernel's fp32 copies
    (inference.MATH_QSIZED_FP32), and the score-sized tensors (score_moment_bytes). 0 for fused kernels, whose
    forward holds less than the backward's recompute of the same block."""
    from memplan.memory.inference import MATH_QSIZED_FP32
    from memplan.memory.layout import blocks
    from memplan.memory.qkv import rotary_positions

    kernel = attention_kernel(ctx, relative_bias=True)
    per_score = score_moment_bytes(ctx, kernel)
    if not per_score:
        return 0
    a = ctx.spec.arch
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    first = next((b for b in blocks(ctx.spec) if b.stack != "encoder"), None)
    attn_in = [m for slot, m in first.linears if slot == "attn_in"] if first else []
    if len(attn_in) == 1:
        qkv = attn_in[0].out_features + ((q_dim + kv_dim) if rotary_positions(ctx) else 0)
    else:
        qkv = q_dim + kv_dim * (1 + a.v_ratio)
    per_token = a.hidden_size * ctx.residual_bytes + qkv * ctx.act_bytes
    if kernel == "eager" and kv_dim < q_dim and not heads_broadcast(ctx):
        per_token += q_dim * (1 + a.v_ratio) * ctx.act_bytes
    elif kernel == "math":
        per_token += MATH_QSIZED_FP32 * q_dim * 4
    s = max(ctx.src_len, ctx.tgt_len)
    b = ctx.setup.batch_size
    return int(b * s * per_token + b * a.num_heads * s * s * per_score)


def held_probs_bytes(ctx: Ctx) -> int:
    """The probabilities a block's last attention returns and the block keeps named to its end (T5Block binds them to
    `_` through its MLP; Llama's decoder layer likewise): extra only where they are a tensor nothing saves, the fp32
    dropout output under autocast in a family that does not cast its probabilities back (T5, BERT, BART: PV's matmul
    saves its own compute-dtype cast). A checkpointed block's recompute holds them until it returns, beside all it
    saves. Found by the tracer: flan-t5-xl QLoRA eager b8 s512 checkpointed, -3.0% at the decoder's last block
    (its cross-attention's [b, heads, t, s] fp32 copy)."""
    a = ctx.spec.arch
    kernel = attention_kernel(ctx, relative_bias=True)
    cast_back = (tuple(a.eager_held) + (False, False, True))[2]
    if kernel != "eager" or not ctx.mixed or cast_back or a.attn_dropout <= 0 or softmax_out_bytes(ctx, kernel) != 4:
        return 0
    return ctx.setup.batch_size * a.num_heads * ctx.tgt_len * ctx.src_len * 4
