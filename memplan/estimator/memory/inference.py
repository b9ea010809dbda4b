"""KV caches (inference's, and the one a training forward builds) and one layer's working set during prefill."""
from __future__ import annotations

from memplan.estimator.memory.recording import graph_blocks
from memplan.estimator.memory.attention import (CACHE_COPIES_SINCE, attention_kernel, kernel_casts_kv, integration_before,
                                     mask_block_bytes, padded_masks, windowed)
from memplan.estimator.memory.position_bias import has_position_bias
from memplan.estimator.memory.qkv import attn_in_linears, rotary_positions
from memplan.estimator.memory.fused_head import trl_head
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.quant import FP8_ROW_QUANT_BYTES
from memplan.estimator.memory.weights import mxfp4_experts
from memplan.estimator.memory.moe import inference_expert_bytes
from memplan import libs
from memplan.estimator.memory.forward_block import MATH_QSIZED_FP32, mlp_live, score_bytes


def kv_cache_bytes(ctx: Ctx) -> int:
    """Bytes of the DynamicCache after generating `new_tokens`.

    Per decoder layer K and V [b, kv_heads, prompt+new-1, head_dim] in the model dtype (transformers cache_utils
    DynamicLayer.update concatenates along the sequence); encoder-decoders also cache cross-attention K/V over the
    encoder length. Encoders keep no cache.
    """
    a, s = ctx.spec.arch, ctx.setup
    if a.kind == "encoder":
        return 0
    new = s.new_tokens if s.new_tokens is not None else 128
    kv_elems = a.kv_cache_elems  # K and V (transformers 5 caches MLA's latent, not expanded K and V)
    # decoders: prompt + new - 1 tokens; encoder-decoders: new - 1 in self-attention + the encoder length in
    # cross-attention (cross_cache_bytes) - the same sum
    per_layer = kv_elems * (ctx.src_len + max(new - 1, 0))
    return s.batch_size * a.num_decoder_layers * per_layer * ctx.compute_bytes


def training_cache_bytes(ctx: Ctx) -> int:
    """Bytes of the DynamicCache a training forward builds without checkpointing, beyond the activations.

    config use_cache defaults to True; GradientCheckpointingLayer turns it off only with checkpointing.
    DynamicLayer.update concatenates each decoder layer's K and V into new tensors (cache_utils torch.cat) held by
    the model output until the loss is taken, so they are gone by backward. Where the attention saves those very
    tensors they cost nothing more (counted in the block's activations); they are extra in blocks that record no
    graph, under autocast over fp32 projections (QLoRA: the kernel saves bf16 casts) and in eager attention with
    grouped K/V (repeat_kv saves expanded copies).
    """
    a, s = ctx.spec.arch, ctx.setup
    if not ctx.training or s.grad_ckpt or a.kind == "encoder" or a.labels_disable_cache or trl_head(ctx):
        # a head given labels may turn the cache off (BART: cachefacts.labels_disable_cache); TRL's fused head
        # calls the backbone with use_cache=False (trl/trainer/utils.py _fused_forward)
        return 0
    eager_copies = ctx.attn_impl == "eager" and a.model_type not in OWN_EAGER_4X
    if (ctx.attn_impl == "sdpa" or eager_copies) and integration_before(ctx, CACHE_COPIES_SINCE):
        return int(_pinned_kv_bytes(ctx) * s.batch_size * ctx.tgt_len * a.num_decoder_layers)
    kv_dim = a.num_kv_heads * a.head_dim
    # decoder self-attention K/V over the decoder tokens; an encoder-decoder's cache also holds the cross-attention
    # K/V over the encoder tokens (EncoderDecoderCache)
    tokens = ctx.tgt_len + (ctx.src_len if a.kind == "seq2seq" else 0)
    promoted = rotary_promotes_kv(ctx)
    per_block = a.kv_cache_elems * s.batch_size * tokens * (ctx.residual_bytes if promoted else ctx.act_bytes)
    if promoted or kernel_casts_kv(ctx) or (
            attention_kernel(ctx, False) == "eager" and kv_dim != a.num_heads * a.head_dim):
        return per_block * a.num_decoder_layers
    recorded = sum(1 for stack, _ in graph_blocks(ctx) if stack == "decoder")
    return per_block * (a.num_decoder_layers - recorded)


#: families whose own 4.x eager attention saves the cache's V view itself (4.48.1 modeling_gpt_neox `_attn`): the
#: cache keeps nothing more there
OWN_EAGER_4X = {"gpt_neox"}

#: families that rotate part of each head and concatenate it with the rest (4.48.1 modeling_gpt_neox / modeling_phi:
#: `torch.cat((query_rot, query_pass), dim=-1)`): K comes out a new contiguous tensor, which sdpa and eager's matmul
#: save as it is, so the cache's K costs nothing more; only V's storage is extra
PARTIAL_ROTARY_CAT = {"gpt_neox", "phi", "stablelm", "persimmon"}


def _pinned_kv_bytes(ctx: Ctx) -> float:
    """Per token and layer, what a training cache before transformers 4.56 keeps alive beside the kernel's copies.

    The kernel makes its own contiguous (or repeated) copies of q, k and v (attention.CACHE_COPIES_SINCE; eager:
    torch.matmul copies the transposed heads to fold them into its batch). The cache keeps the rotated K (a new
    tensor; without rotary a view of its projection's output) and V, a view of its projection's output: the whole
    fused q/k/v output where one Linear makes all three (Phi-3's qkv_proj, GPT-2's c_attn).
    """
    a = ctx.spec.arch
    kv_dim = a.num_kv_heads * a.head_dim
    rotary = rotary_positions(ctx)
    # the kernel saves its own copy of the rotated K - unless K is a concatenation (contiguous already) of the
    # kernel's dtype
    copied = rotary and (a.model_type not in PARTIAL_ROTARY_CAT or rotary_promotes_kv(ctx) or kernel_casts_kv(ctx))
    k_bytes = ctx.residual_bytes if rotary_promotes_kv(ctx) else ctx.act_bytes
    attn_in = attn_in_linears(ctx)
    k_extra = kv_dim * k_bytes if copied else 0
    if len(attn_in) == 1:
        return attn_in[0].out_features * ctx.act_bytes + k_extra
    return k_extra + kv_dim * ctx.act_bytes  # without rotary K is a view of k_proj's output: as large


#: families whose rotary embedding multiplies q and k by cos/sin in the hidden states' dtype (modeling_llama.py
#: LlamaRotaryEmbedding returns cos.to(x.dtype); apply_rotary_pos_emb): under autocast over an fp32 residual stream
#: q*cos promotes q and k to fp32, and DynamicLayer.lazy_initialization (cache_utils.py) makes keys and values in
#: the key's dtype, so the cache's torch.cat holds fp32 K and V while sdpa saves its own bf16 casts.
ROTARY = {"llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "phi", "phi3", "gpt_neox", "falcon"}


def rotary_promotes_kv(ctx: Ctx) -> bool:
    """The training cache holds fp32 K/V beside the kernel's bf16 copies (ROTARY under mixed precision)."""
    return ctx.mixed and ctx.residual_bytes == 4 and ctx.spec.arch.model_type in ROTARY


def prompt_cache_bytes(ctx: Ctx) -> int:
    """Bytes of the cache while the prompt runs.

    Decoders hold the K/V of the layers already run (up to the whole prompt's); an encoder-decoder's prompt pass is
    the encoder, which caches nothing (its cross-attention K/V are made by the first decoder step).
    """
    if ctx.spec.arch.kind == "seq2seq":
        return 0
    kv = kv_cache_bytes(ctx)
    return int(kv * ctx.src_len / max(ctx.src_len + (ctx.setup.new_tokens or 0), 1))


def encoder_output_bytes(ctx: Ctx) -> int:
    """An encoder-decoder's encoder output [b, src, hidden], which its decoder steps read.

    generate() keeps it in model_kwargs["encoder_outputs"] through every decoding step, as the prefill's model call
    holds it through its first decoder step.
    """
    a = ctx.spec.arch
    if a.kind != "seq2seq":
        return 0
    return ctx.setup.batch_size * ctx.src_len * a.hidden_size * ctx.compute_bytes


def cross_cache_bytes(ctx: Ctx) -> int:
    """The cross-attention K/V an encoder-decoder's first decoder step caches for every layer; 0 for other models.

    This is kv_cache_bytes's encoder-length part.
    """
    a = ctx.spec.arch
    if a.kind != "seq2seq":
        return 0
    return ctx.setup.batch_size * a.num_decoder_layers * a.kv_cache_elems * ctx.src_len * ctx.compute_bytes


def kv_growth_bytes(ctx: Ctx) -> int:
    """torch.cat in DynamicCache allocates the grown K (then V) of one layer while the old one is alive."""
    a = ctx.spec.arch
    layers = max(a.num_decoder_layers, 1)
    return kv_cache_bytes(ctx) // (2 * layers) if a.kind != "encoder" else 0


#: Hidden-sized tensors live at a layer's MLP peak under no_grad: the embedding output (held by the model's forward
#: as `inputs_embeds`), the block input (held by the caller's loop), the post-attention residual and the normed MLP
#: input. GPT2Block also keeps its attention output in its `attn_output` local until it returns (HOLDS_ATTN_OUTPUT).
#: Measured: benchmarks/diagnose/cases-3.yaml (gpt2, gpt2-xl bf16 prefill, H100).
PREFILL_HIDDEN = 4
HOLDS_ATTN_OUTPUT = {"gpt2"}


def prefill_working_bytes(ctx: Ctx) -> int:
    """Largest live set inside one layer while the prompt runs.

    Under no_grad tensors are freed as soon as unused, as in a checkpointed block's forward. The largest of: the hidden
    states and q/k/v/out, then the hidden states and the MLP intermediates (PREFILL_HIDDEN, mlp_live); an eager
    attention adds the [b, heads, s, s] tensors its code holds at once (forward_block.score_bytes: Arch.eager_held, the
    fp32 softmax's input copy, the probabilities a layer returns to the model's loop), the math kernel its fp32 copies,
    scores, softmax and mask (MATH_SCORE_BYTES). The MLP moment keeps the probabilities the layer's attention returned
    (Llama's `hidden_states, _ = self.self_attn(...)`) and, where the layer returns them too, the previous layer's.
    """

    a = ctx.spec.arch
    c = ctx.compute_bytes
    t = ctx.setup.batch_size * ctx.src_len
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    k = a.experts_per_token if a.num_experts else 1
    attn = (2 * a.hidden_size + (q_dim + kv_dim) * (1 + a.v_ratio)) * c * t
    kernel = attention_kernel(ctx, relative_bias=True)
    scores = ctx.setup.batch_size * a.num_heads * ctx.src_len * ctx.src_len
    per_score, returned = score_bytes(ctx, kernel, masked=a.kind == "causal" or ctx.setup.padded)
    attn += scores * per_score
    if kernel == "math":  # fp32 q/k/v copies (attention.attention_kernel)
        attn += MATH_QSIZED_FP32 * q_dim * 4 * t
    masks = 0
    if kernel == "fused" and (padded_masks(ctx) or windowed(ctx)):
        # the boolean mask for the whole forward, and per call its float bias and the K/V repeated to every head
        masks = ctx.setup.batch_size * ctx.src_len * ctx.src_len
        attn += mask_block_bytes(ctx, ctx.setup.batch_size, ctx.src_len)
    hidden = PREFILL_HIDDEN + (a.model_type in HOLDS_ATTN_OUTPUT)
    if mxfp4_experts(ctx):
        experts = mxfp4_moe_bytes(ctx, t)
    elif a.num_experts and not a.experts_dense and not libs.older_than("transformers", (5, 0)):
        experts = inference_expert_bytes(ctx, t)  # transformers 5's fused experts, grouped_mm
    else:
        experts = mlp_live(a) * a.intermediate_size * c * k * t
    mlp = hidden * a.hidden_size * c * t + experts + scores * returned * (2 if a.returns_attn_probs else 1)
    return max(attn, mlp, _fp8_row_quant_moment(ctx, hidden, t)) + masks + _position_bias_bytes(ctx, kernel)


def _fp8_row_quant_moment(ctx: Ctx, hidden: int, t: int) -> int:
    """compressed-tensors FP8 served (CompressedTensorsFP8Linear): the largest quantized Linear quantizing its input
    per row (quant.FP8_ROW_QUANT_BYTES per element beside the input itself), with the hidden states; 0 otherwise. At
    the MLP's down projection its input, the gated product, is the one intermediate left."""
    if ctx.setup.quant != "fp8-dynamic" or not ctx.quantized:
        return 0
    k = max(m.in_features for m in ctx.spec.linears if m.name in ctx.quantized)
    c = ctx.compute_bytes
    return hidden * ctx.spec.arch.hidden_size * c * t + (c + FP8_ROW_QUANT_BYTES) * k * t


def mxfp4_moe_bytes(ctx: Ctx, tokens: int) -> int:
    """gpt-oss's MoE block over MXFP4 experts (transformers integrations/mxfp4.py Mxfp4GptOssMLP), beyond its input,
    at its second matmul; from the hub kernel transformers loads (kernels-community gpt-oss-triton-kernels, triton
    7d0efaa: routing.py, matmul_ogs.py init_allocation):
    - the router's logits [tokens, experts];
    - the routing metadata: the gates [routes], a gather and a scatter int32 index per route, the tile map (4 x
      about routes / 16 int32);
    - the first matmul's output, the routes' SwiGLU fused: [routes, intermediate];
    - the second's, its scatter fused: one [tokens + routes, hidden] buffer (the result is a view of its first
      rows, so all of it lives until the block's output is added to the residual), and two int32 write-back
      indices (routes, tokens + routes + 1)."""
    a, c = ctx.spec.arch, ctx.compute_bytes
    routes = tokens * a.experts_per_token
    compute = tokens * a.num_experts + routes * (1 + a.intermediate_size) + (tokens + routes) * a.hidden_size
    ints = 2 * routes + 4 * (routes // 16) + routes + tokens + routes + 1
    return compute * c + ints * 4


def generate_position_bytes(ctx: Ctx) -> int:
    """What generate()'s own prompt pass holds beyond a plain forward's: learned position embeddings per row.

    generate passes position_ids made from the attention mask, [b, s] (GenerationMixin.prepare_inputs_for_generation:
    `attention_mask.cumsum(-1) - 1`, for a forward that takes position_ids), where a plain forward makes [1, s] (from
    cache_position). A learned absolute position embedding (GPT-2's wpe) then returns [b, s, hidden], which the
    model's forward keeps through every layer. The prefill's closed form leaves the [1, s, hidden] out, so the whole
    [b, s, hidden] is counted here. Rotary tables made per row as well (cos and sin, [b, s, rotary size]) are too
    small to count.
    """
    a = ctx.spec.arch
    learned = any(p.role == "pos_embedding" and p.block is None for p in ctx.spec.params)
    if a.kind != "causal" or not learned or ctx.setup.new_tokens == 0:
        return 0
    return ctx.setup.batch_size * ctx.src_len * a.hidden_size * ctx.compute_bytes


def _position_bias_bytes(ctx: Ctx, kernel: str) -> int:
    """T5's relative position bias, computed by the stack's first layer and passed to all.

    [1, heads, s, s] as modeling_t5.py compute_bias makes it. From transformers 5.20 sdpa gets it contiguous, merged
    with the padding mask: expanded over the batch with padding (Setup.padded), else [1, heads, s, s]
    (position_bias.self_bias_mask_bytes).
    """
    a = ctx.spec.arch
    if not has_position_bias(a):
        return 0
    rows = ctx.setup.batch_size if kernel == "fused" and ctx.setup.padded else 1
    return rows * a.num_heads * ctx.src_len * ctx.src_len * ctx.compute_bytes
