"""What CUDA's F.scaled_dot_product_attention runs, for the tracer's CPU (fake or real) tensors: which kernel torch
would pick on CUDA, and what that kernel saves (memplan.runtime.emulate.cuda.EMULATIONS["sdpa"] lists each case).

The CPU picks kernels by other rules: its flash kernel takes masks of any layout and refuses attention dropout and
mask gradients, CUDA's fused kernels refuse masks whose last dimension is strided. Lazy torch: nothing is imported
at module import.
"""
from __future__ import annotations

import math

from memplan.runtime.emulate.masks import is_fake


def cuda_picks_math(query, key, value, attn_mask, enable_gqa: bool, dtype=None) -> bool:
    """torch's CUDA kernel choice falls back to the math kernel: every fused kernel needs the last dimension of q, k,
    v and the mask at stride 1 (aten sdp_utils_cpp.h check_last_dim_stride_equals_1_dense), and K/V with q's heads
    unless enable_gqa (check_batch_size_and_num_heads_dense), which only the flash kernel takes, in fp16/bf16 alone
    (cuda/sdp_utils.cpp; memory.attention.gqa_in_fp32). dtype: what the kernel computes in (autocast's), default
    q's. transformers before 5.20 hands T5's position bias as a permuted view, so its self-attentions take the math
    kernel (memory.attention.MATH_SDPA_UNTIL)."""
    import torch

    strided = any(t.stride(-1) != 1 and t.size(-1) > 1 for t in (query, key, value))
    if attn_mask is not None and attn_mask.dim() and attn_mask.size(-1) > 1 and attn_mask.stride(-1) != 1:
        strided = True
    grouped = key.shape[-3] != query.shape[-3]
    return strided or (grouped and (not enable_gqa or (dtype or query.dtype) == torch.float32))


def math_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """aten _scaled_dot_product_attention_math as CUDA runs it (a composite op: the same aten calls on every device,
    read from torch 2.13's dispatcher and attention.cpp): 16-bit q, k, v upcast to fp32, each kept to the end; q and
    k^T each scaled by sqrt(scale) and saved by QK^T; the mask added in place; _safe_softmax's output saved (its bool
    mask transient); dropout through at::dropout, which on CUDA is native_dropout (a bool mask saved - the CPU's
    at::dropout saves a float noise tensor instead); the weights cast back (the kernel's second output, dropped by
    sdpa); PV saves the probabilities and fp32 v. A boolean mask is first made additive in the query's dtype
    (scaled_dot_product_attention: convert_boolean_attn_mask)."""
    import torch

    with torch.autocast("cpu", enabled=False):  # autocast's sdpa entry casts, then excludes autocast inside
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    import torch

    dtype = query.dtype
    attn_mask = _additive(attn_mask, dtype)
    if dtype in (torch.bfloat16, torch.float16):
        query, key, value = query.float(), key.float(), value.float()
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.size(-1)))
    query_acc, query = query, query * root  # aten keeps its fp32 upcast (query_acc) named beside the scaled query
    if is_causal:
        n_q, n_k = query.size(-2), key.size(-2)
        attn_mask = torch.where(torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(), 0.0,
                                float("-inf"))
    if enable_gqa:  # without it, differing heads broadcast in the matmuls (falcon's one K/V head)
        key, value = _repeat_kv(query, key, value)
    attn = torch.matmul(query, key.transpose(-2, -1) * root)
    if attn_mask is not None:  # in place on CUDA; out of place only for tensor subclasses or under a dispatch mode
        attn.add_(attn_mask)  # (at::areAnyTensorSubclassLike) - as the tracer's own mode would make it
    attn = _safe_softmax(attn)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    # `return make_tuple(matmul(attn, v).to(dtype), attn.to(dtype))`: GCC evaluates the arguments right to left, so
    # the weights (the kernel's second output, dropped by sdpa) are made first and live through PV
    weights = attn.to(dtype)
    out = torch.matmul(attn, value).to(dtype)
    del weights, query_acc
    return out


def _safe_softmax(scores):
    """aten _safe_softmax as CUDA runs it (CompositeExplicitAutograd: the same calls on every device, attention.cpp):
    the softmax, a bool mask of the scores' -inf elements (isneginf) and its all() per row, then where() zeroes the
    fully masked rows into the softmax's own output. Called as one op, the fake mode's meta kernel makes the output
    alone; the mask, one byte per score beside the scores and the output until the op returns, is made here."""
    import torch

    out = torch.ops.aten._safe_softmax(scores, -1)
    masked = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    rows = torch.empty((*scores.shape[:-1], 1), dtype=torch.bool, device=scores.device)
    del masked, rows
    return out


def _additive(mask, dtype):
    """A boolean mask as the additive float bias sdpa makes of it (aten convert_boolean_attn_mask); others as is."""
    import torch
    if mask is not None and mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask


def _repeat_kv(query, key, value):
    """Grouped K/V repeated to every query head, as enable_gqa does (the stand-ins below take no groups)."""
    if key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    return key, value


def cuda_sdpa(original_sdpa):
    """A stand-in for F.scaled_dot_product_attention that runs what CUDA would: the math kernel where CUDA falls
    back to it, the CPU flash kernel (what CUDA's flash/efficient kernels keep) otherwise, and stand-ins of CUDA's
    efficient kernel where the CPU has none (a trainable bias, values of another head size)."""
    import torch

    class FlashWithBiasGrad(torch.autograd.Function):
        """CUDA's memory-efficient sdpa kernel with a trainable bias (aten _scaled_dot_product_efficient_attention,
        derivatives.yaml: query, key, value, attn_bias all differentiable): forward saves q, k, v, the bias, the
        output and the logsumexp; backward returns q/k/v gradients and a [b, h, q, k] bias gradient, allocated with
        its last dim padded to 16 like attention_backward.cu _efficient_attention_backward (grad_bias =
        at::empty(padded).slice(-1, 0, k)). Fake tensors only: the bias gradient's values are not computed."""

        @staticmethod
        def forward(ctx, q, k, v, mask, is_causal, scale):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
            ctx.save_for_backward(q, k, v, mask, out, lse)
            ctx.is_causal, ctx.scale = is_causal, scale
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, mask, out, lse = ctx.saved_tensors
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale)
            shape = torch.broadcast_shapes(mask.shape, (*q.shape[:-1], k.shape[-2]))
            t = shape[-1]
            gbias = torch.empty((*shape[:-1], -(-t // 16) * 16), dtype=mask.dtype, device=mask.device)[..., :t]
            return gq, gk, gv, gbias, None, None  # the engine sums gbias down to the mask's shape

    class EfficientOtherValueSize(torch.autograd.Function):
        """CUDA's memory-efficient sdpa kernel where the values' head size differs from the queries' (aten
        _scaled_dot_product_efficient_attention; derivatives.yaml saves query, key, value, attn_bias, output and
        logsumexp): forward returns the output [b, h, q, v size] (stored [b, q, h, v size]: attention.cu) and keeps
        a logsumexp [b, h, q rounded up to 32] fp32 (attention.cu _efficient_attention_forward, kAlignLSE = 32);
        backward returns the q, k, v gradients. Fake tensors only: shapes and dtypes, no values."""

        @staticmethod
        def forward(ctx, q, k, v, mask):
            b, h, s, _ = q.shape  # the kernel writes [b, s, h, d] and returns it transposed, like the flash kernels
            out = q.new_empty((b, s, h, v.shape[-1])).transpose(1, 2)
            lse = q.new_empty((*q.shape[:-2], -(-q.shape[-2] // 32) * 32), dtype=torch.float32)
            ctx.save_for_backward(q, k, v, mask, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, mask, out, lse = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    def _autocast(query, key, value, attn_mask):
        """autocast's sdpa entry (lower-precision list) casts every floating argument to the compute dtype (.to
        keeps a permuted mask's strides); the aten calls and stand-ins below bypass it"""
        if torch.is_autocast_enabled("cpu"):
            dt = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dt) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dt)
        return query, key, value, attn_mask

    def _other_value_size(query, key, value) -> bool:
        align = 4 if query.dtype == torch.float32 and not torch.is_autocast_enabled("cpu") else 8
        return (is_fake(query) and value.shape[-1] != query.shape[-1] and query.shape[-1] == key.shape[-1]
                and query.shape[-1] % align == 0 and value.shape[-1] % align == 0)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        if cuda_picks_math(query, key, value, attn_mask, enable_gqa, dtype):
            query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
            return math_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if _other_value_size(query, key, value):
            query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
            key, value = _repeat_kv(query, key, value)
            return EfficientOtherValueSize.apply(query, key, value, _additive(attn_mask, query.dtype))
        if dropout_p == 0.0:  # the CPU runs its flash kernel (masks included) like CUDA's flash/efficient ones
            return original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa)
        # with dropout the CPU's sdpa would run its math kernel: its flash kernel is called directly. Grouped K/V
        # (enable_gqa) stay as they are: CUDA's flash kernel takes them, like the CPU's (santacoder's one K/V head)
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
        attn_mask = _additive(attn_mask, query.dtype)
        if attn_mask is not None and attn_mask.requires_grad:
            key, value = _repeat_kv(query, key, value)  # CUDA's efficient kernel takes no grouped K/V
            # a trainable bias as mask (T5's relative positions: full fine-tuning trains relative_attention_bias;
            # gradient checkpointing sets position_bias.requires_grad): the CPU flash kernel refuses its gradient
            # (autograd's check runs above the fake mode, so fake tensors refuse it too). Real CPU tensors: the
            # math kernel, dropout mask included; fake ones: CUDA's efficient kernel, which returns the bias gradient
            if not is_fake(query):
                return original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                     is_causal=is_causal, scale=scale)
            return FlashWithBiasGrad.apply(query, key, value, attn_mask, is_causal, scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]

    return sdpa
