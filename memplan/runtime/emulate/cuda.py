"""Where the CPU path differs from CUDA, what the tracer does instead: one place for every emulation.

cuda_like() applies them around a traced (or CPU-validated) step; EMULATIONS documents each one. Lazy torch: nothing
is imported at module import.
"""
from __future__ import annotations

import contextlib

from memplan.runtime.emulate.autocast import cuda_autocast_fp32
from memplan.runtime.emulate.masks import is_fake, mask_checks
from memplan.runtime.emulate.sdpa import cuda_sdpa


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
                    "always (emulate.masks.mask_checks)",
    "bitsandbytes": "bnb Linear4bit/Linear8bitLt do not run on fake tensors: stand-in layers hold exactly the "
                    "storages bnb allocates and dequantize to the compute dtype in forward and backward",
    "low-bit and schedule-free optimizers": "stand-ins allocate the states of bitsandbytes' Lion 8/32-bit and "
                                            "paged AdamW 32-bit (fp32, or uint8 + an fp32 absmax per 256), torchao's "
                                            "AdamW 8/4-bit (quantized states, per-block scales, code tables) and "
                                            "schedulefree's AdamW (z and exp_avg_sq), none of which run on fake "
                                            "tensors; memplan.runtime.standins",
    "bnb-8bit-optimizers": "a stand-in optimizer allocates bnb's blockwise 8-bit state (uint8 state1/state2 + one "
                           "fp32 absmax per 256 elements; fp32 below 4096 elements); paged state lives outside the "
                           "allocator (cudaMallocManaged) and is excluded from the allocated peak",
    "data-dependent checks": "transformers 4.x drops an all-ones attention mask for sdpa after "
                             "`torch.all(mask == 1)` (modeling_attn_mask_utils _ignore_causal_mask_sdpa, "
                             "_prepare_4d_attention_mask_for_sdpa) and draws `torch.rand([])` against LayerDrop (BART, "
                             "OPT): fake tensors cannot be read, so the tracer answers `not Setup.padded` to the "
                             "first, as a real run of its batches would, and draws 1.0 for the second, so every layer "
                             "runs",
    "grouped_mm": "MoE experts (transformers grouped_mm): torch's meta kernel takes bf16 only; for fp32/fp16 the "
                  "tracer allocates the one output CUDA's _grouped_mm_fallback writes into",
    "softmax backward": "CUDA's softmax backward allocates a gradient-sized `grad * output` temporary beside its "
                        "result (SoftMax.cu softmax_backward_cuda_out); the CPU kernel does not, so the tracer "
                        "allocates it around aten._softmax_backward_data",
    "autocast": "CPU autocast (the CUDA autocast key only applies to CUDA tensors) with CUDA's cast policy laid "
                "over it by a function mode (memplan.runtime.emulate.autocast): CUDA's fp32 ops (pow, exp, rsqrt, "
                "layer_norm, the losses, ...) cast up, softmax/log_softmax/cumsum/sum/norms into fp32 outputs, "
                "CUDA's promote list, the matmuls only CUDA lowers (einsum, mv, ...); CPU-only policies (cat/stack "
                "promotion by copy, fp32 fft/linalg) switched off; cross_entropy as CUDA's decomposition runs it (a "
                "16-bit log_softmax cast up for nll_loss). Checked op by op against the AutocastCUDA kernels "
                "(tests/test_cuda_parity.py)",
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
            "aligned), so fake tensors go through a stand-in of that kernel. Where CUDA's kernel choice falls back "
            "to the math kernel (a mask or q/k/v whose last dimension is strided, K/V heads without enable_gqa: "
            "aten sdp_utils_cpp.h), the tracer runs that composite kernel with CUDA's dropout (emulate.sdpa)",
}

@contextlib.contextmanager
def cuda_like(padded: bool = False, seq2seq: bool = False):
    """The CUDA code paths the CPU would not take (EMULATIONS): native_dropout for dropout, the flash-style sdpa
    kernel with attention dropout, grouped_mm's output for fp32/fp16 experts, the softmax backward's temporary, CUDA
    autocast's fp32 op list, and transformers' mask checks answered for fake masks (padded: the batch holds padding;
    seq2seq: an encoder-decoder, whose decoder mask is all ones)."""
    import torch
    import torch.nn.functional as F

    original = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        # inplace ignored on purpose: native_dropout always returns a new tensor (inplace=True: vision heads only)
        if training and p > 0:
            return torch.native_dropout(x, p, True)[0]
        return x

    original_sdpa = F.scaled_dot_product_attention
    F.dropout = dropout
    F.scaled_dot_product_attention = cuda_sdpa(original_sdpa)
    try:
        with _cuda_kernels(), cuda_autocast_fp32(), mask_checks(padded, seq2seq):
            yield
    finally:
        F.dropout = original
        F.scaled_dot_product_attention = original_sdpa


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


def _cuda_kernels():
    """What CUDA kernels allocate that the CPU's do not, in a dispatch mode (the backward calls them from C++):
    - torch's meta kernel for aten._grouped_mm (fake tensors) accepts bf16 only, while the CUDA kernel also runs
      fp32 and fp16 (transformers' MoE experts call it in the weights' dtype: fp32 under bf16-mixed and QLoRA): the
      CUDA output is allocated for those;
    - CUDA's softmax backward first makes `tmp = grad * output`, a gradient-sized temporary beside its result
      (aten/src/ATen/native/cuda/SoftMax.cu softmax_backward_cuda_out); the CPU kernel makes none. Every eager
      attention's softmax (and the math sdpa kernel's _safe_softmax) ends its backward there."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._grouped_mm.default and is_fake(args[0]) and not (
                    args[0].dtype == args[1].dtype == torch.bfloat16):
                return _grouped_mm_output(*args, **kwargs)
            if func is torch.ops.aten._softmax_backward_data.default:
                out = func(*args, **kwargs)  # the structured kernel's result is allocated before its body runs
                torch.empty_like(args[0])  # then its body's `tmp = grad * output`, freed as it returns
                return out
            return func(*args, **kwargs)

    return _Mode()
