"""Where the CPU path differs from CUDA, what the tracer does instead: one place for every emulation.

cuda_like() applies them around a traced (or CPU-validated) step; trace.EMULATIONS documents each one. Lazy torch:
nothing is imported at module import.
"""
from __future__ import annotations

import contextlib

from memplan.emulate_masks import mask_checks


#: Where the CPU path differs from CUDA, what the tracer does instead (applied by cuda_like() below).
EMULATIONS = {
    "adamw": "torch.optim.AdamW(foreach=True): CUDA's default (torch.optim.optimizer._default_to_fused_or_foreach "
             "picks foreach only for CUDA tensors; on CPU it would pick the per-tensor loop)",
    "adamw-fused": "torch.optim.AdamW(fused=True) (Trainer's adamw_torch_fused); the fused kernel also exists on CPU",
    "dropout": "F.dropout -> torch.native_dropout: the CUDA path (one bool mask saved); the CPU path draws a float "
               "mask with bernoulli_",
    "padding mask": "transformers reads the attention mask to skip it (no padding: sdpa's is_causal, grouped K/V "
                    "passed through with enable_gqa); fake masks cannot be read (masking_utils is_tracing), so the "
                    "tracer answers from its batch: all ones unless Setup.padded, a seq2seq decoder's own mask "
                    "always (emulate_masks.mask_checks)",
    "bitsandbytes": "bnb Linear4bit/Linear8bitLt do not run on fake tensors: stand-in layers hold exactly the "
                    "storages bnb allocates and dequantize to the compute dtype in forward and backward",
    "bnb-8bit-optimizers": "a stand-in optimizer allocates bnb's blockwise 8-bit state (uint8 state1/state2 + one "
                           "fp32 absmax per 256 elements; fp32 below 4096 elements); paged state lives outside the "
                           "allocator (cudaMallocManaged) and is excluded from the allocated peak",
    "data-dependent checks": "transformers 4.x drops an all-ones attention mask for sdpa after "
                             "`torch.all(mask == 1)` (modeling_attn_mask_utils _ignore_causal_mask_sdpa, "
                             "_prepare_4d_attention_mask_for_sdpa) and draws `torch.rand([])` against LayerDrop (BART, "
                             "OPT): fake tensors cannot be read, so the tracer answers `not Setup.padded` to the first, "
                             "as a real run of its batches would, and draws 1.0 for the second, so every layer runs",
    "grouped_mm": "MoE experts (transformers grouped_mm): torch's meta kernel takes bf16 only; for fp32/fp16 the "
                  "tracer allocates the one output CUDA's _grouped_mm_fallback writes into",
    "autocast": "CPU autocast (the CUDA autocast key only applies to CUDA tensors): its lower-precision op list "
                "matches CUDA's for matmuls; CUDA's fp32 list (pow, exp, log, rsqrt, softplus, layer_norm, "
                "logsumexp, softmax/log_softmax/cumsum with dtype=float32, ...) is applied by a function mode "
                "(emulations.AUTOCAST_FP32)",
    "sdpa": "with attention dropout the CPU falls back to the math kernel (saving [b, h, s, s] probabilities and "
            "a dropout mask); CUDA runs the flash/memory-efficient kernels, which regenerate dropout from a saved RNG "
            "state. The tracer then calls the CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu: "
            "output + logsumexp saved) with the mask and without dropout. A trainable mask (T5's position bias in full "
            "fine-tuning or under checkpointing) has no gradient in the CPU kernel: fake tensors go through a "
            "stand-in of CUDA's efficient kernel (saves q, k, v, bias, output, logsumexp; returns a [b, h, q, k] bias "
            "gradient padded to 16), real ones through the math kernel; under autocast q, k, v "
            "and a float mask are first cast to the compute dtype, as autocast's sdpa entry does. Values with a "
            "head size other than the queries' (DeepSeek's MLA: q/k 192, v 128) have no CPU flash kernel and would "
            "take the math kernel ([b, h, s, s] scores); CUDA's flash kernel refuses them too but its memory-"
            "efficient one takes them (sdp_utils.cpp check_head_dim_size_mem_efficient: q and k equal, both sizes "
            "aligned), so fake tensors go through a stand-in of that kernel",
}

@contextlib.contextmanager
def cuda_like(padded: bool = False, seq2seq: bool = False):
    """The CUDA code paths the CPU would not take (memplan.trace.EMULATIONS): native_dropout for dropout, the
    flash-style sdpa kernel with attention dropout, grouped_mm's output for fp32/fp16 experts, CUDA autocast's
    fp32 op list, and transformers' mask checks answered for fake masks (padded: the batch holds padding; seq2seq:
    an encoder-decoder, whose decoder mask is all ones)."""
    import torch
    import torch.nn.functional as F

    original = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if training and p > 0:
            return torch.native_dropout(x, p, True)[0]
        return x

    original_sdpa = F.scaled_dot_product_attention

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
        a logsumexp [b, h, q rounded up to 32] fp32
        (attention.cu _efficient_attention_forward, kAlignLSE = 32); backward returns the q, k, v gradients.
        Fake tensors only: shapes and dtypes, no values."""

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
        """autocast's sdpa entry (lower-precision list) casts every floating argument to the compute dtype; the
        aten calls and stand-ins below bypass it"""
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
        if _other_value_size(query, key, value):
            query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
            if key.shape[-3] != query.shape[-3]:  # the efficient kernel takes no groups: sdpa repeats K/V
                rep = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~attn_mask, float("-inf"))
            return EfficientOtherValueSize.apply(query, key, value, attn_mask)
        if dropout_p == 0.0:  # the CPU runs its flash kernel (masks included) like CUDA's flash/efficient ones
            return original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                 scale=scale, enable_gqa=enable_gqa)
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
        if key.shape[-3] != query.shape[-3]:  # grouped-query attention: expand like enable_gqa
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf"))
        if attn_mask is not None and attn_mask.requires_grad:
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

    F.dropout = dropout
    F.scaled_dot_product_attention = sdpa
    try:
        with _grouped_mm_any_dtype(), cuda_autocast_fp32(), mask_checks(padded, seq2seq):
            yield
    finally:
        F.dropout = original
        F.scaled_dot_product_attention = original_sdpa


#: CUDA autocast's fp32 ops (aten/src/ATen/autocast_mode.cpp AT_FORALL_FP32, registered for the CUDA Autocast key
#: only: CPU autocast leaves them in bf16), and those it runs with dtype=float32 (AT_FORALL_FP32_SET_OPT_DTYPE)
AUTOCAST_FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                 "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm",
                 "logsumexp", "cosine_similarity", "dist", "pdist", "cdist", "renorm"}
AUTOCAST_FP32_DTYPE = {"softmax", "log_softmax", "cumsum", "cumprod", "prod"}


def cuda_autocast_fp32():
    """While CPU autocast is on, run CUDA autocast's fp32 ops in fp32 (16-bit tensor arguments cast up first): e.g.
    gelu_new's torch.pow, whose fp32 cast and outputs CUDA saves (14 B per element instead of 8). Found with the H100
    rows: the tracer was 10-14% below every gpt2 bf16-mixed measurement, the estimate within 0.6%."""
    import torch
    from torch.overrides import TorchFunctionMode

    half = (torch.bfloat16, torch.float16)

    def up(a):
        if isinstance(a, torch.Tensor) and a.dtype in half:
            return a.float()
        return type(a)(up(x) for x in a) if isinstance(a, (list, tuple)) else a

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch.is_autocast_enabled("cpu"):
                name = getattr(func, "__name__", "")
                if name in AUTOCAST_FP32:
                    args, kwargs = up(args), {k: up(v) for k, v in kwargs.items()}
                elif (name in AUTOCAST_FP32_DTYPE and kwargs.get("dtype") is None and args
                      and isinstance(args[0], torch.Tensor) and args[0].dtype in half):
                    kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)

    return _Mode()


def checkpoint_kwargs() -> dict:
    """torch.utils.checkpoint arguments (non-reentrant, as Trainer's plan files set): the recompute re-enters the
    CPU emulation of CUDA autocast's fp32 ops (cuda_autocast_fp32), which the autograd engine does not carry into
    backward; otherwise recomputed values differ from the forward's and checkpoint raises. The mode only acts under
    CPU autocast: a no-op on the GPU."""
    import contextlib

    return {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), cuda_autocast_fp32())}


def _grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """What CUDA's _grouped_mm allocates: one output in mat_a's dtype, its last dimension's stride padded to 16 bytes
    (aten/src/ATen/native/GroupedMMUtils.h create_grouped_gemm_output_tensor); fp32/fp16 inputs run through
    _grouped_mm_fallback, a loop of mm_out into that output (native/cuda/GroupedBlas.cpp)."""
    import torch

    torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm: {mat_a.dtype} x {mat_b.dtype}")
    torch._check(bias is None and out_dtype in (None, mat_a.dtype), lambda: "grouped_mm: bias / out_dtype")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    align = 16 // mat_a.element_size()
    padded = -(-size[-1] // align) * align
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype, device=mat_a.device)


def _grouped_mm_any_dtype():
    """torch's meta kernel for aten._grouped_mm (fake tensors) accepts bf16 only, while the CUDA kernel also runs
    fp32 and fp16 (transformers' MoE experts call it in the weights' dtype: fp32 under bf16-mixed and QLoRA). A
    dispatch mode (the backward calls it from C++) allocates the CUDA output for those."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._grouped_mm.default and is_fake(args[0]) and not (
                    args[0].dtype == args[1].dtype == torch.bfloat16):
                return _grouped_mm_output(*args, **kwargs)
            return func(*args, **kwargs)

    return _Mode()


def is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)
