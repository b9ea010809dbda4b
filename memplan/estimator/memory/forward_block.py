"""The forward's own peak inside a checkpointed block.

Under torch.utils.checkpoint (non-reentrant, transformers' default: modeling_utils gradient_checkpointing_enable)
the block's forward saves nothing (the pack hook drops every saved tensor), so each tensor is freed once unused,
but an eager or math-kernel attention holds several [b, heads, s, s] tensors at once while its softmax runs. With
every block's checkpoint input alive by the last block, that moment can top the backward's phases where the
attention's code keeps more score-sized tensors named than the backward holds: Falcon (its raw scores beside the
masked sum and the probabilities, plus the previous layer's probabilities, which its layer returns to the model's
loop), BLOOM.

Also here: the block's MLP moment with the probabilities its layer keeps (working_bytes), what a checkpointed block's
recompute holds to its end (held_probs_bytes) and DeepSeek-V3.2's indexer, a forward transient of every layer
(indexer_bytes)."""
from __future__ import annotations

from memplan.estimator.memory.attention import QK_FP32, attention_kernel, heads_broadcast, kernel_bytes, softmax_out_bytes
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.qkv import attn_in_linears, rotary_positions
from memplan.model.layout import blocks
from memplan.model.trainable import gets_no_grad


def score_bytes(ctx: Ctx, kernel: str, masked: bool = True) -> tuple[int, int]:
    """Score-sized bytes per element inside one checkpointed attention's forward.

    For the eager code as the family writes it (Arch.eager_held, attnfacts.eager_held) and aten's math kernel
    (_scaled_dot_product_attention_math: fp32 scores, the mask added in place, the softmax a new tensor beside
    _safe_softmax's bool mask: MATH_SCORE_BYTES); sdpa's fused kernels hold and return none. masked: the attention
    adds a float mask (causal self-attention; an unpadded encoder's and cross-attention get none).

    Eager, per element: the scores (kb: the matmul's dtype, fp32 for QK_FP32 families outside autocast) scaled into a
    new tensor (2 kb); the masked sum (pb: promoted to the additive mask's dtype, the residual stream's,
    masking_utils); the softmax output (sb, attention.softmax_out_bytes) beside the sum and, where softmax converts a
    16-bit input to fp32 first (aten SoftMax.cpp softmax: only CUDA Half to Float skips the copy), that copy; the
    cast back to q's dtype beside both; with attention dropout the probabilities, the dropped copy and native_dropout's
    bool mask; PV's matmul, under autocast with a compute-dtype copy of fp32 probabilities. Falcon's raw scores stay
    named through the softmax, BLOOM's scores and sum to the end; a layer that returns its probabilities
    (Arch.returns_attn_probs) keeps the previous layer's alive through the whole moment.

    Returns:
        (bytes per [b, heads, q, k] element alive at once, bytes per element of the probabilities the attention
        returns to its layer).
    """
    a = ctx.spec.arch
    drop = a.attn_dropout > 0 and ctx.setup.mode == "train"  # generate() runs the model in eval mode
    if kernel == "math":  # at the softmax: the fp32 scores, its output and its bool mask; at a dropout, the scores
        return MATH_SCORE_BYTES, 0  # gone: the softmax's output, native_dropout's output and bool mask - as many
    if kernel != "eager":
        return 0, 0
    held_scores, held_sum, cast_back = a.eager_held
    c = kernel_bytes(ctx)
    kb = 4 if a.model_type in QK_FP32 and not ctx.mixed else c
    pb = max(kb, ctx.residual_bytes) if masked else kb
    sb = softmax_out_bytes(ctx, kernel)
    converts = sb == 4 and pb < 4 and "fp16" not in ctx.setup.precision
    qb = query_bytes(ctx)
    cast = qb if cast_back and qb != sb else 0
    probs = cast or sb
    scores = kb if held_scores else 0
    # unmasked, the scores are the softmax's input: named (Llama's attn_weights) until its output replaces them
    moments = [2 * kb, kb + pb, pb + (4 if converts else 0) + sb + (scores if masked else 0)]
    if cast:
        moments.append(pb + sb + cast + scores)
    kept = (pb + scores) if held_sum else 0
    if drop:
        moments.append(2 * probs + 1 + kept)
    # PV's matmul: under autocast a compute-dtype copy of fp32 probabilities (BLOOM's bmm beside its scores and sum)
    moments.append(probs + (c if ctx.mixed and probs != c else 0) + kept)
    return max(moments) + (probs if a.returns_attn_probs else 0), probs


def query_bytes(ctx: Ctx) -> int:
    """Bytes per element of the queries an eager attention casts its probabilities back to.

    The projections' dtype, but fp32 under autocast where a query norm with an fp32 weight follows them (Qwen3's
    RMSNorm returns `weight * x.to(input_dtype)`, fp32 x bf16).
    """

    first = next(iter(blocks(ctx.spec)), None)
    return 4 if ctx.mixed and first is not None and first.qk_norm_widths else ctx.act_bytes


def working_bytes(ctx: Ctx) -> int:
    """What one checkpointed block holds at its largest forward moment, besides its checkpoint input.

    At its attention's softmax: the normed input (residual dtype), q, k and v as the projections return them
    (act_bytes, q and k as query_bytes; a fused projection's whole output, which its views keep, plus rotated q and
    k), K and V repeated to every head for an eager attention over grouped K/V (transformers repeat_kv), the math
    kernel's fp32 copies (MATH_QSIZED_FP32), and the score-sized tensors (score_bytes). Or at its MLP, where the
    layer still holds the probabilities its attention returned. 0 for fused kernels, whose forward holds less than
    the backward's recompute of the same block. The checkpoint input is counted with the activations.
    """

    kernel = attention_kernel(ctx, relative_bias=True)
    per_score, returned = score_bytes(ctx, kernel)
    if not per_score:
        return 0
    a = ctx.spec.arch
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    attn_in = attn_in_linears(ctx)
    qb, vb = query_bytes(ctx), ctx.act_bytes
    if len(attn_in) == 1:
        per_token = attn_in[0].out_features * vb + ((q_dim + kv_dim) * qb if rotary_positions(ctx) else 0)
    else:
        per_token = (q_dim + kv_dim) * qb + kv_dim * a.v_ratio * vb
    per_token += a.hidden_size * ctx.residual_bytes
    if kernel == "eager" and kv_dim < q_dim and not heads_broadcast(ctx):
        per_token += q_dim * (qb + a.v_ratio * vb)
    elif kernel == "math":
        per_token += MATH_QSIZED_FP32 * q_dim * 4
    s = max(ctx.src_len, ctx.tgt_len)
    b = ctx.setup.batch_size
    if a.kind == "seq2seq":  # the encoder's last block (no mask unless padded), then the decoder's
        src = b * a.num_heads * ctx.src_len ** 2
        enc_moment, enc_probs = score_bytes(ctx, kernel, masked=ctx.setup.padded)
        return int(max(b * ctx.src_len * per_token + src * enc_moment,
                       _mlp_bytes(ctx, b * ctx.src_len, src * enc_probs),
                       _decoder_bytes(ctx, kernel, b * ctx.tgt_len * per_token)))
    scores = b * a.num_heads * s * s
    # the layer keeps the probabilities its attention returned (`hidden_states, _ = self.self_attn(...)`)
    mlp = _mlp_bytes(ctx, b * s, scores * returned * (2 if a.returns_attn_probs else 1))
    return int(max(b * s * per_token + scores * per_score, mlp))


def _mlp_bytes(ctx: Ctx, tokens: int, held: int) -> int:
    """A block's forward at its MLP.

    The residual sum and its norm, the intermediates (mlp_live) in the activations' dtype, and `held`, the
    probabilities the layer keeps from its attentions' returns.
    """

    a = ctx.spec.arch
    k = a.experts_per_token if a.num_experts else 1
    return tokens * (2 * a.hidden_size * ctx.residual_bytes + mlp_live(a) * a.intermediate_size * k * ctx.act_bytes) \
        + held


def _decoder_bytes(ctx: Ctx, kernel: str, qkv: int) -> int:
    """The forward's largest moment in an encoder-decoder's last decoder block.

    Its causal self-attention over [t, t], then its cross-attention over [t, s] (no mask unless padded) while the
    layer keeps the self-attention's probabilities (BART's `hidden_states, self_attn_weights = self.self_attn(...)`),
    then its MLP with both.
    """
    a = ctx.spec.arch
    b, t, s = ctx.setup.batch_size, ctx.tgt_len, ctx.src_len
    self_moment, self_probs = score_bytes(ctx, kernel)
    cross_moment, cross_probs = score_bytes(ctx, kernel, masked=ctx.setup.padded)
    tt, ts = b * a.num_heads * t * t, b * a.num_heads * t * s
    return max(qkv + tt * self_moment, qkv + ts * cross_moment + tt * self_probs,
               _mlp_bytes(ctx, b * t, tt * self_probs + ts * cross_probs))


def held_probs_bytes(ctx: Ctx) -> int:
    """The probabilities a block's last attention returns and the block keeps named to its end.

    T5Block binds them to `_` through its MLP; Llama's decoder layer likewise. They are extra only where nothing
    saves them: the fp32 dropout output under autocast in a family that does not cast its probabilities back (T5,
    BERT, BART: PV's matmul saves its own compute-dtype cast). A checkpointed block's recompute holds them until it
    returns, beside all it saves.
    """
    a = ctx.spec.arch
    kernel = attention_kernel(ctx, relative_bias=True)
    cast_back = a.eager_held[2]
    if kernel != "eager" or not ctx.mixed or cast_back or a.attn_dropout <= 0 or softmax_out_bytes(ctx, kernel) != 4:
        return 0
    return ctx.setup.batch_size * a.num_heads * ctx.tgt_len * ctx.src_len * 4


def indexer_bytes(ctx: Ctx) -> int:
    """DeepSeek-V3.2's lightning indexer in one attention's forward (modeling_deepseek_v32 DeepseekV32Indexer).

    A transient of every layer, checkpointed or not, since its top-k indices carry no gradient and nothing it computes
    is saved. torch.matmul broadcasts q.float() [b, s, h, d] against k.float() [b, 1, d, t], copying k to
    [b, s, d, t] (from batch 2: at batch 1 it folds into one mm) beside its [b, s, h, t] fp32 scores; the scaling and
    relu each make a second score tensor. Under autocast the matmul casts its fp32 inputs back to the compute dtype,
    so the copy and the scores are 16-bit. Beside them: the indexer's q and k (_indexer_qk_bytes) and what the
    attention holds when it calls the indexer (_mla_locals_bytes; without checkpointing these are what the block has
    saved so far: attention_phases.in_forward_phases leaves the block's own saves out of the activations).
    Arch.indexer: (h, d, rotary size).
    """
    h, d, _ = ctx.spec.arch.indexer
    if not h:
        return 0
    b, s = ctx.setup.batch_size, max(ctx.src_len, ctx.tgt_len)
    copied = d if b > 1 else 0  # at batch 1 the broadcast folds into one mm: no copy of k
    e = ctx.compute_bytes if ctx.autocast else 4  # autocast runs the matmul on compute-dtype casts of the fp32 copies
    named, cast = _indexer_qk_bytes(ctx)
    return b * s * (max(s * (copied + h) * e + cast, s * 2 * h * e) + named + _mla_locals_bytes(ctx))


def _rotated_bytes(ctx: Ctx) -> int:
    """Bytes per element of a rotated q or k part and of its torch.cat with the unrotated part.

    fp32 under autocast over an fp32 stream (the compute-dtype part times the stream's fp32 cos and sin promotes,
    and the cat with it), else the activations' dtype.
    """
    return 4 if ctx.mixed else ctx.act_bytes


def _indexer_qk_bytes(ctx: Ctx) -> tuple[int, int]:
    """Per token, bytes of the indexer's q and k at its scores' matmul.

    Named: q as wq_b returns it [h, d] (its unrotated part a view of it), its rotated part [h, r] and their
    torch.cat (fp32 under autocast: the rotated part promotes it); k likewise at one head, its LayerNorm's output
    fp32 under autocast. The matmul's inputs, freed once it returns (before the scaling's second score tensor):
    q.float()'s and k.float()'s copies where the cat is 16-bit and, under autocast, their compute-dtype casts.

    Returns:
        (named bytes, the matmul's own input bytes) per token.
    """
    h, d, r = ctx.spec.arch.indexer
    act, rot = ctx.act_bytes, _rotated_bytes(ctx)
    cat = rot  # torch.cat takes the rotated part's dtype
    norm = 4 if ctx.autocast else act  # layer_norm is on autocast's fp32 list
    inputs = (4 if cat != 4 else 0) + (ctx.compute_bytes if ctx.autocast else 0)
    return h * d * (act + cat) + h * r * rot + d * (act + norm + cat) + r * rot, (h + 1) * d * inputs


def _mla_locals_bytes(ctx: Ctx) -> int:
    """Per token, what DeepSeek-V3.2's attention holds when it calls its indexer (DeepseekV32Attention.forward).

    The normed input (residual dtype), the outputs of its projections before the core (q_a_proj's, q_b_proj's,
    kv_a_proj_with_mqa's and kv_b_proj's, their views named), the rotated q and k parts, query_states' torch.cat
    ([heads, head size], fp32 under autocast) and key_states, a new tensor of kv_b_proj's dtype.
    """

    a = ctx.spec.arch
    first = next(iter(blocks(ctx.spec)), None)
    out = next((m for slot, m in first.linears if slot == "attn_out"), None) if first else None
    if out is None:
        return 0
    prefix = out.name.rsplit(".", 1)[0] + "."
    projected = sum(m.out_features for slot, m in first.linears
                    if m.name.startswith(prefix) and m is not out and not gets_no_grad(ctx.spec, m.name))
    r, rot = a.indexer[2], _rotated_bytes(ctx)
    q_dim = a.num_heads * a.head_dim
    return a.hidden_size * ctx.residual_bytes + projected * ctx.act_bytes + (a.num_heads + 1) * r * rot \
        + q_dim * rot + q_dim * ctx.act_bytes


#: What PyTorch's math SDPA kernel holds at its softmax (aten _scaled_dot_product_attention_math, attention.cpp):
#: four fp32 q-sized tensors (q, k and v upcast, kept named to the end, and the scaled q) and per score element the
#: fp32 scores, the softmax's fp32 output and _safe_softmax's bool mask of the scores (its composite's isneginf,
#: freed when it returns): 9 bytes. Inside QK^T's matmul the kernel holds more q-sized tensors (the scaled k^T and
#: bmm's contiguous copies of q and k: 7) but one score tensor: the softmax's moment is the larger from a sequence of
#: about 2.4 head sizes on.
#: Measured: t5-base bf16 b8 s512 inference at sdpa_attention_forward, reproduced by memplan.runtime.emulate.sdpa.
MATH_QSIZED_FP32 = 4


MATH_SCORE_BYTES = 9


#: Intermediate-sized tensors live at the MLP peak. Gated (down(act(gate(x)) * up(x))): gate(x) dies when act
#: returns, so act, up and their product: 3. Plain: fc1's output and the activation's output: 2, plus the
#: temporaries of activations written as several python ops: transformers NewGELUActivation ("gelu_new",
#: 0.5 * x * (1 + tanh(c * (x + 0.044715 * x^3)))) keeps fc1's output and three temporaries: 4.
#: Measured: gpt2 and gpt2-xl prefill (transformers activations.py:66).
MLP_LIVE_PLAIN = {"gelu_new": 4}


def mlp_live(a) -> int:
    """Intermediate-sized tensors live at the MLP peak: 3 gated, else MLP_LIVE_PLAIN's count or 2."""
    if a.mlp_gated:
        return 3
    return MLP_LIVE_PLAIN.get(a.hidden_act, 2)
