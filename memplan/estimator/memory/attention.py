"""Attention: which kernel a setup's attention runs, in which dtype, and what one attention saves for backward.

Kernels: eager, sdpa's fused kernels or its math fallback; memplan.estimator.memory.activations adds the saves per
block.
"""
from __future__ import annotations

from memplan import libs
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.position_bias import has_position_bias

# Whether a family's eager attention computes softmax in fp32 explicitly and casts back (fp32 probs + a copy) is read
# from its modeling code when its inventory is built (Arch.eager_softmax_fp32, attnfacts.eager_facts):
# `softmax(..., dtype=torch.float32).to(query.dtype)` in Llama's eager_attention_forward and every family generated
# from it, BLOOM; gpt2, bert, bart, t5 (5.15 on) and falcon call softmax in the input dtype.

#: families whose eager softmax was fp32 in older transformers releases, until the given one: T5 and mT5 called
#: `softmax(scores.float(), dim=-1).type_as(scores)` (T5Attention.forward, 4.48.1 to 5.14.0) and softmax in the
#: scores' dtype from 5.15.
SOFTMAX_FP32_UNTIL = {"t5": (5, 15), "mt5": (5, 15)}

#: families whose eager attention casts q and k to fp32 before QK^T ("Keep the attention weights computation in
#: fp32", modeling_gptj.py / modeling_codegen.py `_attn`): without autocast the matmul saves the fp32 casts and the
#: scores and their softmax are fp32.
QK_FP32 = {"gptj", "codegen"}

#: transformers before 5.20 handed T5's relative position bias to sdpa as a permuted view (modeling_t5 compute_bias
#: `values.permute([2, 0, 1])`; integrations/sdpa_attention.create_position_bias_mask made it contiguous from 5.20
#: on). torch's fused kernels need the mask's last dimension contiguous (aten sdp_utils
#: check_last_dim_stride_equals_1), so the self-attentions ran sdpa's math kernel; the cross-attentions (zero bias)
#: ran fused. Measured: benchmarks/diagnose/cases-1.yaml (H100).
MATH_SDPA_UNTIL = (5, 20)


#: transformers 4.x releases of integrations/sdpa_attention.py, the sdpa path of every family that calls
#: ALL_ATTENTION_FUNCTIONS (4.48.1: Llama, Mistral, Mixtral, Qwen2, Phi, Phi-3, Gemma, Gemma-2, GPT-2, ...). Before 4.54
#: grouped K/V were repeated to every head for every call (`repeat_kv`; 4.54 added use_gqa_in_sdpa / enable_gqa);
#: before 4.53 the model built one additive float [b, 1, q, k] mask per forward in the hidden states' dtype
#: (_update_causal_mask), shared by every layer, where 4.53's masking_utils passes a boolean mask sdpa converts per
#: call.
GQA_IN_SDPA_SINCE = (4, 54)
BOOL_MASKS_SINCE = (4, 53)
#: before 4.56 sdpa_attention_forward made q, k and v contiguous (`query = query.contiguous()`, for torch issue
#: 112577) and DynamicCache kept its first update's K and V themselves (cache_utils `self.keys = key_states`); from
#: 4.56 the copies are gone and the cache concatenates into new tensors (DynamicLayer.lazy_initialization +
#: torch.cat) that the kernel saves (inference.training_cache_bytes)
CACHE_COPIES_SINCE = (4, 56)
#: causal families whose 4.x attention had its own sdpa code (4.48.1 modeling files without ALL_ATTENTION_FUNCTIONS):
#: the release rules of the shared integration (above; CACHE_COPIES_SINCE in inference) are not applied to them.
#: GPT-NeoX's own 4.48 sdpa function copies q/k/v the same way (`query = query.contiguous()`) and is left in
OWN_SDPA_4X = {"bloom", "falcon", "gpt_bigcode", "opt"}


def integration_before(ctx: Ctx, release: tuple[int, int]) -> bool:
    """The family's attention uses transformers' shared attention functions, in a release older than `release`.

    Source: eager_attention_forward, integrations/sdpa_attention.py.
    """
    a = ctx.spec.arch
    return a.kind == "causal" and a.model_type not in OWN_SDPA_4X and libs.older_than("transformers", release)


def sdpa_integration_before(ctx: Ctx, release: tuple[int, int]) -> bool:
    """The attention runs transformers' shared sdpa integration, from a release older than `release`."""
    return ctx.attn_impl == "sdpa" and integration_before(ctx, release)


def kernel_casts_kv(ctx: Ctx) -> bool:
    """The attention computes on compute-dtype casts of q, k and v and saves those instead of the tensors.

    This is autocast over projections that return fp32 (QLoRA: bitsandbytes Linear4bit returns the input's dtype).
    """
    return ctx.mixed and ctx.act_bytes != ctx.compute_bytes


def kernel_bytes(ctx: Ctx) -> int:
    """Bytes per element of what the attention computes on.

    Autocast runs sdpa and the eager matmuls in the compute dtype (both on its lower-precision list), whatever
    dtype the projections return: QLoRA's fp32 q/k/v are saved as bf16 casts.
    """
    return ctx.compute_bytes if kernel_casts_kv(ctx) else ctx.act_bytes


def _softmax_fp32(ctx: Ctx, c: int) -> bool:
    """Whether the eager softmax runs in fp32.

    It does under autocast (softmax is on its fp32 list), in fp32 models, where the family asks for it
    (Arch.eager_softmax_fp32; SOFTMAX_FP32_UNTIL before the release named), or where its scores are fp32 already
    (QK_FP32).
    """
    a = ctx.spec.arch
    return (ctx.autocast or c == 4 or a.eager_softmax_fp32 or a.model_type in QK_FP32
            or libs.older_than("transformers", SOFTMAX_FP32_UNTIL.get(a.model_type, ())))


#: families that hand sdpa K/V with fewer heads than q and no enable_gqa (falcon-7b's multi-query attention:
#: modeling_falcon.py FalconAttention._split_heads keeps one K/V head and calls F.scaled_dot_product_attention
#: without enable_gqa): torch's check_batch_size_and_num_heads_dense (aten sdp_utils_cpp.h, shared by CPU and CUDA)
#: rules out every fused kernel, so the math kernel runs, in fp32 with the full score matrix.
SDPA_HEADS_BROADCAST = {"falcon"}


def heads_broadcast(ctx: Ctx) -> bool:
    """K/V reach the attention matmuls with fewer heads and are broadcast, not repeated (SDPA_HEADS_BROADCAST)."""
    a = ctx.spec.arch
    return a.model_type in SDPA_HEADS_BROADCAST and a.num_kv_heads != a.num_heads


def gqa_in_fp32(ctx: Ctx) -> bool:
    """Grouped K/V reach sdpa with enable_gqa in fp32, so sdpa's math kernel runs.

    transformers passes enable_gqa when there is no mask (integrations/sdpa_attention.py use_gqa_in_sdpa, from
    4.54). CUDA's flash kernel, the one fused kernel taking grouped K/V, takes fp16/bf16 only, so the math kernel
    runs: K/V repeated to every head, fp32 scores. Source: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
    check_batch_size_and_num_heads_dense (<true> for flash, <false> for mem-efficient).
    """
    a = ctx.spec.arch
    return (ctx.attn_impl == "sdpa" and a.num_kv_heads != a.num_heads and not heads_broadcast(ctx)
            and not sdpa_integration_before(ctx, GQA_IN_SDPA_SINCE) and kernel_bytes(ctx) == 4
            and not padded_masks(ctx) and not windowed(ctx))


def attention_kernel(ctx: Ctx, relative_bias: bool) -> str:
    """The kernel one attention runs, which decides what its scores cost.

    relative_bias: the attention gets a learned position bias.

    Returns:
        "eager", "math" or "fused".
    """
    if ctx.attn_impl == "eager":
        return "eager"
    if ctx.attn_impl == "sdpa" and (heads_broadcast(ctx) or gqa_in_fp32(ctx)):
        return "math"
    if (relative_bias and ctx.attn_impl == "sdpa" and has_position_bias(ctx.spec.arch)
            and libs.older_than("transformers", MATH_SDPA_UNTIL)):
        return "math"
    return "fused"


#: families whose attention reads k and v as views of one fused projection that stays saved (GPT-2's c_attn split in
#: GPT2Attention.forward; the view q keeps it alive). Training without checkpointing still builds a DynamicCache
#: (config use_cache defaults to True; GradientCheckpointingLayer turns it off only with checkpointing), whose update
#: concatenates k and v into new tensors (cache_utils DynamicLayer.update, torch.cat) that the fused kernel then saves
#: beside the fused output q keeps alive (eager's count already has k and v as tensors of their own). Where k and v
#: are separate projections (or rotated copies) the concatenated copies replace them instead.
#: Measured: benchmarks/diagnose (gpt2, H100).
FUSED_QKV_CACHE = {"gpt2"}


def attn_core(ctx: Ctx, q_dim: int, kv_dim: int, q_tok: int, k_tok: int, kernel: str) -> tuple[float, float]:
    """Bytes one attention saves for backward, per query token and per score element.

    sdpa/flash (torch _scaled_dot_product_{flash,efficient}_attention): q, k, v, out and fp32 logsumexp per head;
    k/v at kv_dim (transformers passes enable_gqa when no mask is needed: integrations/sdpa_attention.py
    use_gqa_in_sdpa). Eager: repeat_kv expands k/v to all heads; QK^T saves q and k, PV saves probs and v; the
    probabilities are one fp32 softmax output plus a compute-dtype copy, or with dropout a mask and a dropped copy.
    Math kernel (aten _scaled_dot_product_attention_math): 16-bit q/k/v are upcast to fp32 (torch >= 2.5, unless
    allow_fp16_bf16_reduction_math_sdp), q and k scaled by sqrt(scale) are saved by QK^T, v by PV; the fp32 softmax
    output, and with dropout a bool mask and the dropped fp32 probabilities.

    Returns:
        (bytes per query token, bytes per score element).
    """
    a = ctx.spec.arch
    c = kernel_bytes(ctx)
    ratio = k_tok / q_tok
    vr = a.v_ratio  # v and the output at their own head size (MLA: CUDA's efficient kernel, emulations "sdpa")
    # broadcast K/V (heads_broadcast): torch.matmul expands them to every head and reshapes to 3-D - a copy, except
    # at batch 1 where the reshape is a stride-0 view and they stay at kv_dim
    if (heads_broadcast(ctx) and ctx.setup.batch_size > 1) or (
            kernel == "fused" and sdpa_integration_before(ctx, GQA_IN_SDPA_SINCE)) or (kernel == "math" and gqa_in_fp32(ctx)):
        kv_dim = q_dim
    if kernel == "math":
        return (q_dim + (1 + vr) * kv_dim * ratio) * 4, 4 + (1 + 4 if a.attn_dropout > 0 else 0)
    if kernel == "fused":
        return (1 + vr) * (q_dim + kv_dim * ratio) * c + a.num_heads * 4, 0.0
    fp32_softmax = _softmax_fp32(ctx, c)
    probs = 4 if fp32_softmax else c
    drop = a.attn_dropout > 0
    if drop:
        probs += 1 + c
    elif fp32_softmax and c != 4:
        probs += c
    if a.attn_logit_softcap:  # Gemma2 eager_attention_forward: tanh(scores / cap) saves its output
        probs += c
    # repeat_kv - or, in falcon, a broadcasting batched matmul (above) - materialises K and V at all heads
    kv = (kv_dim if heads_broadcast(ctx) else q_dim) * ratio
    qk = 4 if a.model_type in QK_FP32 and not ctx.mixed else c  # under autocast the matmul saves its bf16 casts
    return q_dim * qk + kv * qk + kv * vr * c, probs


def score_grad_bytes(ctx: Ctx, q_len: int | None = None, k_len: int | None = None) -> int:
    """Bytes of the three score-sized gradients inside an eager or math attention's backward.

    The probabilities' gradient (PV's backward), the softmax backward's output and CUDA's softmax backward's own
    `tmp = grad * output`, [b, heads, s_q, s_k] each in the softmax dtype; fused kernels work tile by tile.
    s_q = s_k = the longer sequence unless given (an encoder-decoder's decoder block: its target length against
    the source's). Source: aten bmm / _softmax_backward_data, aten/src/ATen/native/cuda/SoftMax.cu
    softmax_backward_cuda_out.
    """
    kernel = attention_kernel(ctx, relative_bias=True)
    s = max(ctx.src_len, ctx.tgt_len)
    return 3 * ctx.setup.batch_size * ctx.spec.arch.num_heads * (q_len or s) * (k_len or s) * \
        softmax_out_bytes(ctx, kernel)


def softmax_out_bytes(ctx: Ctx, kernel: str) -> int:
    """Bytes per score element of an eager or math softmax's output (and of the gradients through it); 0 fused."""
    c = kernel_bytes(ctx)
    return 0 if kernel == "fused" else 4 if kernel == "math" or _softmax_fp32(ctx, c) else c


def windowed(ctx: Ctx) -> bool:
    """sdpa gets an explicit mask from the sliding window because the sequence reaches the window.

    Source: transformers masking_utils _ignore_causal_mask_sdpa keeps the mask once
    `kv_length >= local_attention_size`; 4.x's AttentionMaskConverter skipped it only while
    `key_value_length < sliding_window`, so a sequence equal to the window builds it.
    """
    a = ctx.spec.arch
    # models mixing full and sliding layers (config.layer_types: Gemma-3) window their sliding layers the same way
    # as Mistral (bool mask, where-converted bias, repeat_kv clones); the full layers get is_causal
    return (ctx.attn_impl == "sdpa" and bool(a.sliding_layers) and a.sliding_window is not None
            and ctx.tgt_len >= a.sliding_window)


def padded_masks(ctx: Ctx) -> bool:
    """sdpa gets an explicit mask in every attention because the batch holds padding (Setup.padded).

    transformers builds a boolean [b, 1, q, k] mask instead of passing is_causal (masking_utils
    _ignore_causal_mask_sdpa / _ignore_bidirectional_mask_sdpa read the padding mask). T5's relative position bias
    merges the mask itself (self_bias_mask_bytes, position_bias_bytes).
    """
    return ctx.attn_impl == "sdpa" and ctx.setup.padded and not has_position_bias(ctx.spec.arch)


def mask_block_bytes(ctx: Ctx, batch: int, q_len: int, k_len: int | None = None) -> float:
    """What a masked sdpa call saves beyond the fused kernel's count (attn_core).

    The mask comes from padding or a sliding window the sequence outruns. torch converts the boolean mask to a
    [b, 1, q, k] float bias in the query's dtype per call (aten sdpa convert_boolean_attn_mask), which the
    efficient kernel keeps for backward. With a mask transformers does not pass enable_gqa
    (integrations/sdpa_attention use_gqa_in_sdpa) but repeats grouped K/V to every head (repeat_kv), which the
    kernel saves instead.
    """
    a = ctx.spec.arch
    c = kernel_bytes(ctx)
    k_len = k_len or q_len
    if sdpa_integration_before(ctx, BOOL_MASKS_SINCE):
        return 0.0  # one shared float mask (phases._mask_bytes) and K/V repeated anyway (attn_core)
    repeated = sdpa_integration_before(ctx, GQA_IN_SDPA_SINCE)  # attn_core counts them
    repeat = 0 if repeated else 2 * (a.num_heads - a.num_kv_heads) * a.head_dim * c
    return batch * q_len * k_len * c + batch * k_len * repeat
