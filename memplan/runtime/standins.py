"""Stand-ins for bitsandbytes under the tracer: bnb layers and optimizers do not run on fake tensors, so these hold
exactly the storages bitsandbytes allocates and allocate its temporaries (memplan.runtime.emulate.cuda.EMULATIONS,
"bitsandbytes" and "bnb-8bit-optimizers"). Lazy torch: classes are built on first use.
"""
from __future__ import annotations

import contextlib
import functools
import math

from memplan.setup import PREQUANTIZED, Setup, quant_groups


@functools.cache
def standin_linear_classes():
    """nn.Linear subclasses holding bitsandbytes' storages (bnb 0.50: Params4bit packed uint8 [n/2, 1], absmax
    fp32 per 64 weights, or with compress_statistics uint8 absmax + fp32 absmax per 256 blocks + fp32 offset;
    Int8Params int8 [out, in] + fp32 SCB [out]). tests/test_trace.py checks the sizes against real bnb objects."""
    import torch

    class _Dequant4(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, layer):
            w = layer.dequantize(x.dtype)  # bnb dequantize_4bit: a [out, in] tensor in the compute dtype
            ctx.layer = layer
            return torch.nn.functional.linear(x, w)

        @staticmethod
        def backward(ctx, grad):
            w = ctx.layer.dequantize(grad.dtype)  # bnb MatMul4Bit.backward dequantizes again
            return grad @ w, None

    class StandIn4bit(torch.nn.Linear):
        def __init__(self, src: torch.nn.Linear, quant_type: str, double_quant: bool, compute_dtype):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = src.in_features, src.out_features
            n = src.in_features * src.out_features
            dev = src.weight.device
            self.weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=dev),
                                             requires_grad=False)
            blocks = math.ceil(n / 64)
            if double_quant:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=dev))
                self.register_buffer("absmax2", torch.empty(math.ceil(blocks / 256), dtype=torch.float32,
                                                            device=dev))
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=dev))
            else:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=dev))
            self.bias = src.bias
            self.compute_dtype = compute_dtype
            self.double_quant = double_quant

        def dequantize(self, dtype):
            if self.double_quant:  # nested absmax dequantized to fp32 first
                _ = torch.empty(self.absmax.shape, dtype=torch.float32, device=self.weight.device)
            return torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.weight.device)

        def forward(self, x):  # bnb Linear4bit.forward: compute in compute_dtype, return in the input's dtype
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            if self.bias is not None and self.bias.dtype != x.dtype:
                self.bias.data = self.bias.data.to(x.dtype)  # bnb casts the bias in place, once
            out = _Dequant4.apply(x, self)
            out = out + self.bias if self.bias is not None else out
            return out.to(inp_dtype)

    class _Int8(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, layer):  # bnb MatMul8bitLt: A.to(fp16), int8 row quantization, int32 matmul
            t = x.numel() // x.shape[-1]
            _a16 = x.to(torch.float16)
            _qa = torch.empty(t, x.shape[-1], dtype=torch.int8, device=x.device)  # int8 quantized input
            _stats = torch.empty(t, dtype=torch.float32, device=x.device)  # row absmax
            _acc = torch.empty(t, layer.out_features, dtype=torch.int32, device=x.device)  # int8 matmul result
            ctx.layer = layer
            return torch.empty(*x.shape[:-1], layer.out_features, dtype=x.dtype, device=x.device)

        @staticmethod
        def backward(ctx, grad):
            layer = ctx.layer
            w = torch.empty(layer.out_features, layer.in_features, dtype=grad.dtype, device=grad.device)
            return grad @ w, None

    class StandIn8bit(torch.nn.Linear):
        def __init__(self, src: torch.nn.Linear, compute_dtype):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = src.in_features, src.out_features
            dev = src.weight.device
            self.weight = torch.nn.Parameter(torch.empty(src.out_features, src.in_features, dtype=torch.int8,
                                                         device=dev), requires_grad=False)
            self.register_buffer("SCB", torch.empty(src.out_features, dtype=torch.float32, device=dev))
            self.bias = src.bias
            self.compute_dtype = compute_dtype

        def forward(self, x):  # bnb Linear8bitLt.forward: output in the input's dtype, bias cast once in place
            if self.bias is not None and self.bias.dtype != x.dtype:
                self.bias.data = self.bias.data.to(x.dtype)
            out = _Int8.apply(x, self)
            return out + self.bias if self.bias is not None else out

    return StandIn4bit, StandIn8bit


@functools.cache
def prequantized_standin_class():
    """An nn.Module holding a stored-quantized Linear as its CUDA kernel keeps it
    (memplan.estimator.memory.weights.prequantized_state_bytes).

    Inference, the default kernel: GPTQ and AWQ after Marlin's repack, FP8's FineGrainedFP8 layer; the forward
    allocates the output alone, as the fused kernels do (they multiply the packed weight in their own tiles).
    Training (LoRA on a GPTQ base): gptqmodel's kernels train through TorchLinear (TritonV2Linear.forward defers to
    it when self.training; `_can_use_triton_dequant` refuses training), which keeps the stored layout (qweight,
    qzeros, scales, g_idx and two tiny shift tables) and in forward unpacks the whole weight with torch ops
    (PackableQuantLinear.dequantize_weight: int32 shifts, int8 codes for 4-bit / int16 for 8-bit, the group's
    scales and zeros gathered per row), casts it to the input's dtype and multiplies with torch.matmul, which saves
    it for the input gradient. The same ops run here on the stand-in's buffers. peft wraps it in its GPTQLoraLinear
    (lora_custom_modules)."""
    import torch

    group, workspace = 128, 132

    class StandInPrequantized(torch.nn.Module):
        def __init__(self, src: torch.nn.Linear, quant: str, training: bool = False, group_size: int = group):
            super().__init__()
            k, n, dev = src.in_features, src.out_features, src.weight.device
            self.in_features, self.out_features = k, n
            self.infeatures, self.outfeatures = k, n  # the names peft reads off a GPTQ QuantLinear
            self.training_kernel = training
            groups = quant_groups(k, group_size)
            i32 = dict(dtype=torch.int32, device=dev)
            if quant.startswith("gptq"):
                bits = PREQUANTIZED[quant]
                self.bits, self.group_size = bits, group_size
                self.register_buffer("qweight", torch.empty(math.ceil(k * bits / 32), n, **i32))
                if training:
                    self.register_buffer("qzeros", torch.empty(groups, math.ceil(n * bits / 32), **i32))
                self.register_buffer("scales", torch.empty(groups, n, dtype=torch.float16, device=dev))
                if training:
                    self.register_buffer("g_idx", torch.empty(k, **i32))
                    per = 32 // bits
                    self.register_buffer("wf_unsqueeze_zero", torch.empty(1, 1, per, **i32), persistent=False)
                    self.register_buffer("wf_unsqueeze_neg_one", torch.empty(1, per, 1, **i32), persistent=False)
                else:
                    self.register_buffer("workspace", torch.empty(workspace, **i32))
            elif quant == "awq":
                self.register_buffer("qweight", torch.empty(k, math.ceil(n * 4 / 32), **i32))
                self.register_buffer("qzeros", torch.empty(groups, math.ceil(n * 4 / 32), **i32))
                self.register_buffer("scales", torch.empty(groups, n, dtype=torch.float16, device=dev))
                self.register_buffer("workspace", torch.empty(workspace, **i32))
            elif quant == "fp8-dynamic":  # transformers' CompressedTensorsFP8Linear: a per-channel fp32 scale
                self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev))
                self.register_buffer("weight_scale", torch.empty(1, n, dtype=torch.float32, device=dev))
            else:  # fp8
                self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev))
                self.register_buffer("weight_scale_inv", torch.empty(math.ceil(n / group), math.ceil(k / group),
                                                                     dtype=torch.float32, device=dev))
            self.quant = quant
            self.bias = src.bias

        def dequantize_weight(self):
            """The [in, out] weight in the scales' dtype, unpacked as gptqmodel's torch path does."""
            codes = torch.int16 if self.bits == 8 else torch.int8
            per = 32 // self.bits
            zeros = torch.bitwise_right_shift(self.qzeros.unsqueeze(2).expand(-1, -1, per), self.wf_unsqueeze_zero)
            zeros = torch.bitwise_and(zeros.to(codes), 2 ** self.bits - 1).reshape(self.scales.shape)
            weight = torch.bitwise_right_shift(self.qweight.unsqueeze(1).expand(-1, per, -1), self.wf_unsqueeze_neg_one)
            weight = torch.bitwise_and(weight.to(codes), 2 ** self.bits - 1)
            weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
            rows = self.g_idx.long()
            return self.scales[rows] * (weight - zeros[rows])

        def forward(self, x):
            shape = (*x.shape[:-1], self.out_features)
            if self.quant == "fp8-dynamic":  # quantize_fp8_per_row in torch ops, then the scaled matmul's output
                x_float = x.reshape(-1, x.shape[-1]).to(torch.float32)
                row_max = x_float.abs().amax(dim=-1)
                scales = torch.where(row_max > 0, row_max, torch.ones_like(row_max)) / 448.0
                _x_fp8 = torch.clamp(x_float / scales.unsqueeze(-1), min=-448.0, max=448.0).to(torch.float8_e4m3fn)
                del x_float
                return x.new_empty(shape)  # scaled_mm adds the bias in its epilogue
            if not self.training_kernel:
                out = x.new_empty(shape)
                return out + self.bias if self.bias is not None else out
            x = x.reshape(-1, x.shape[-1])
            w = self.dequantize_weight()
            if w.dtype != x.dtype:
                w = w.to(x.dtype)
            out = torch.matmul(x, w).reshape(shape)
            if self.bias is not None:
                out.add_(self.bias if self.bias.dtype == out.dtype else self.bias.to(out.dtype))
            return out

    return StandInPrequantized


@functools.cache
def awq_training_standin_class():
    """An AWQ Linear as gptqmodel's trainable kernel holds and runs it (AwqConfig(backend="auto_trainable") picks
    AwqGEMMLinear, qlinear/gemm_awq.py, gptqmodel f4c327a): qweight int32 [k, n / 8], qzeros int32 [k / g, n / 8],
    fp16 scales [k / g, n] and an fp16 bias buffer (buffers: peft's fp32 upcast passes them by). forward casts a
    non-16-bit input to fp16 and AwqGemmFn saves that input for backward; it dequantizes the whole [k, n] weight
    for a matmul above AWQ_DEQUANT_ABOVE rows, or runs the split-K GEMM (fp32 partials [AWQ_SPLIT_K, t, n]); the
    output returns in the input's dtype. backward dequantizes again and repeats the transposed weight per batch row
    ([b, n, k]) for a bmm. peft wraps it in AwqLoraLinear (lora_custom_modules)."""
    import torch
    from memplan.model.compat import AWQ_DEQUANT_ABOVE, AWQ_SPLIT_K

    group = 128

    class _AwqGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, layer):
            ctx.save_for_backward(x)
            ctx.layer = layer
            if x.shape[0] * x.shape[1] > AWQ_DEQUANT_ABOVE:
                out = torch.matmul(x, layer.dequantize().to(x.dtype))
            else:
                rows = x.reshape(-1, x.shape[-1]).shape[0]
                _partials = torch.empty(AWQ_SPLIT_K, rows, layer.out_features, dtype=torch.float32, device=x.device)
                out = torch.empty(rows, layer.out_features, dtype=x.dtype, device=x.device)
                del _partials
            out = out + layer.bias if layer.bias is not None else out
            out = out.reshape(*x.shape[:-1], layer.out_features)
            return out.unsqueeze(0) if out.dim() == 2 else out

        @staticmethod
        def backward(ctx, grad):
            weights = ctx.layer.dequantize().to(grad.dtype)
            grad_input = None
            if ctx.needs_input_grad[0]:
                grad_input = grad.bmm(weights.transpose(0, 1).unsqueeze(0).repeat(grad.shape[0], 1, 1))
            return grad_input, None

    class StandInAwqTrainable(torch.nn.Module):
        def __init__(self, src: torch.nn.Linear, group_size: int = group):
            super().__init__()
            k, n, dev = src.in_features, src.out_features, src.weight.device
            self.in_features, self.out_features = k, n
            self.infeatures, self.outfeatures = k, n  # what peft reads off a gptqmodel layer
            groups = quant_groups(k, group_size)
            i32 = dict(dtype=torch.int32, device=dev)
            self.register_buffer("qweight", torch.empty(k, math.ceil(n * 4 / 32), **i32))
            self.register_buffer("qzeros", torch.empty(groups, math.ceil(n * 4 / 32), **i32))
            self.register_buffer("scales", torch.empty(groups, n, dtype=torch.float16, device=dev))
            self.register_buffer("bias", None if src.bias is None else
                                 torch.empty(n, dtype=torch.float16, device=dev))

        def dequantize(self):
            """The [k, n] weight in the scales' dtype (the AWQ CUDA dequantize_weights kernel writes it at once)."""
            return torch.empty(self.in_features, self.out_features, dtype=self.scales.dtype,
                               device=self.qweight.device)

        def forward(self, x):
            out_shape = (*x.shape[:-1], self.out_features)
            input_dtype = x.dtype
            compute = input_dtype if input_dtype in (torch.float16, torch.bfloat16) else torch.float16
            if input_dtype != compute:
                x = x.to(compute)
            elif not x.is_contiguous():
                x = x.contiguous()
            if self.scales.dtype != compute:  # _ensure_runtime_dtype: the scales and bias follow the input
                self.scales = self.scales.to(compute)
                self.bias = None if self.bias is None else self.bias.to(compute)
            out = _AwqGemm.apply(x, self)
            if out.dtype != input_dtype:
                out = out.to(input_dtype)
            return out.reshape(out_shape)

    return StandInAwqTrainable


@functools.cache
def fp8_training_standin_class():
    """An FP8 Linear as transformers (5.22 on) trains through it (integrations/finegrained_fp8.py FP8Linear, an
    nn.Linear, so peft wraps it in its own lora.Linear and all-linear finds it): float8_e4m3fn weight [n, k] and
    fp32 weight_scale_inv [ceil(n / 128), ceil(k / 128)], frozen parameters. FP8LinearFunction runs where the input
    needs a gradient: the fused kernel writes the output alone and saves only the weight and its scales; backward
    dequantizes (_dequantize_fp8_weight: the scales and the weight cast to the gradient's dtype, the scales repeated
    over each block's rows, multiplied in place) and returns grad @ weight."""
    import torch

    block = 128

    class _Fp8Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, layer):
            ctx.layer = layer
            return layer.kernel(x)

        @staticmethod
        def backward(ctx, grad):
            layer = ctx.layer
            scale = layer.weight_scale_inv.to(grad.dtype)
            weight = layer.weight.to(grad.dtype)
            # the scales over each block's rows, kept (a view) to the return; the in-place block multiply of a
            # view of the weight allocates nothing
            scale = scale.repeat_interleave(block, dim=-2)[:weight.shape[0], :]
            return grad @ weight, None

    class StandInFp8Trainable(torch.nn.Linear):
        def __init__(self, src: torch.nn.Linear):
            torch.nn.Module.__init__(self)
            k, n, dev = src.in_features, src.out_features, src.weight.device
            self.in_features, self.out_features = k, n
            self.weight = torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev),
                                             requires_grad=False)
            self.weight_scale_inv = torch.nn.Parameter(
                torch.empty(math.ceil(n / block), math.ceil(k / block), dtype=torch.float32, device=dev),
                requires_grad=False)
            self.bias = src.bias

        def kernel(self, x):  # fp8_linear: the activations quantized in the kernel's tiles, the output in x's dtype
            out = x.new_empty(*x.shape[:-1], self.out_features)
            return out.add_(self.bias) if self.bias is not None else out

        def forward(self, x):  # transformers' _apply_if_grad: the autograd function only where x needs a gradient
            if torch.is_grad_enabled() and x.requires_grad:
                return _Fp8Linear.apply(x, self)
            return self.kernel(x)

    return StandInFp8Trainable


@functools.cache
def torchao_standin_class():
    """A Linear whose weight is a torchao weight-only tensor (0.18, quantization/quantize_/workflows), as
    TorchAoConfig loads it: an nn.Linear, so peft wraps it in (its subclass of) lora.Linear and all-linear finds it.
    int8 (Int8Tensor, per row): int8 qdata [n, k], fp32 scale and int8 zero_point [n, 1]; its linear multiplies by
    the int8 weight cast to the input's dtype (torch.mm, which saves that cast where the input needs a gradient),
    then scales the [t, n] product per row into a second one. int4 (Int4Tensor, plain packing): two int4 per byte
    [n, k / 2], scale and zero_point [k / 128, n] in the model's dtype; mslk's bf16i4bf16_rowwise kernel writes the
    output alone (served only: peft trains on int8 alone)."""
    import torch

    group = 128

    class StandInTorchao(torch.nn.Linear):
        def __init__(self, src: torch.nn.Linear, bits: int, dtype, group_size: int = group):
            torch.nn.Module.__init__(self)
            k, n, dev = src.in_features, src.out_features, src.weight.device
            self.in_features, self.out_features, self.bits = k, n, bits
            groups = quant_groups(k, group_size)
            if bits == 8:
                self.weight = torch.nn.Parameter(torch.empty(n, k, dtype=torch.int8, device=dev), requires_grad=False)
                self.register_buffer("scale", torch.empty(n, 1, dtype=torch.float32, device=dev))
                self.register_buffer("zero_point", torch.empty(n, 1, dtype=torch.int8, device=dev))
            else:
                self.weight = torch.nn.Parameter(torch.empty(n, k // 2, dtype=torch.int8, device=dev),
                                                 requires_grad=False)
                self.register_buffer("scale", torch.empty(groups, n, dtype=dtype, device=dev))
                self.register_buffer("zero_point", torch.empty(groups, n, dtype=dtype, device=dev))
            self.bias = src.bias

        def forward(self, x):
            rows = x.reshape(-1, x.shape[-1])
            if self.bits == 8:
                m = torch.mm(rows, self.weight.t().to(x.dtype))
                y = m * self.scale.to(m.dtype).flatten()
            else:
                y = rows.new_empty(rows.shape[0], self.out_features)
            y = y.reshape(*x.shape[:-1], self.out_features)
            if self.bias is not None:
                y = y + self.bias if self.bits == 4 else y.add_(self.bias)
            return y

    return StandInTorchao


@functools.cache
def mxfp4_standin_class():
    """gpt-oss's MoE block as transformers runs it over MXFP4 experts with the Triton kernels (integrations/mxfp4.py
    Mxfp4GptOssMLP, Mxfp4GptOssExperts): the router's logits, the routing metadata, then two matmul_ogs calls, the
    first gathering each token's routes and fusing the SwiGLU ([tokens x top-k, intermediate]), the second scattering
    them back weighted by the gates ([tokens, hidden]). The experts' storage: uint8 blocks (two E2M1 values per
    byte) and uint8 E8M0 scales (one per 32 values) of gate_up [experts, 2 x intermediate, hidden] and down
    [experts, hidden, intermediate], fp32 biases. Inference only (transformers dequantizes MXFP4 to train)."""
    import torch

    class StandInMxfp4MLP(torch.nn.Module):
        def __init__(self, mlp, config):
            super().__init__()
            e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
            dev = mlp.router.weight.device
            self.router, self.top_k, self.hidden, self.inter = mlp.router, config.num_experts_per_tok, h, i
            u8 = dict(dtype=torch.uint8, device=dev)
            self.register_buffer("gate_up_proj", torch.empty(e, 2 * i, h // 2, **u8))
            self.register_buffer("gate_up_proj_scales", torch.empty(e, 2 * i, h // 32, **u8))
            self.register_buffer("gate_up_proj_bias", torch.empty(e, 2 * i, dtype=torch.float32, device=dev))
            self.register_buffer("down_proj", torch.empty(e, h, i // 2, **u8))
            self.register_buffer("down_proj_scales", torch.empty(e, h, i // 32, **u8))
            self.register_buffer("down_proj_bias", torch.empty(e, h, dtype=torch.float32, device=dev))

        def forward(self, hidden_states):
            batch = hidden_states.shape[0]
            x = hidden_states.reshape(-1, self.hidden)
            logits = torch.nn.functional.linear(x, self.router.weight, self.router.bias)
            tokens = x.shape[0]
            routes = tokens * self.top_k
            i32 = dict(dtype=torch.int32)
            # triton_kernels routing.routing (hub kernel, triton 7d0efaa): the gates, the gather / scatter indices
            # (one int32 pair per route) and the per-tile map (4 x about routes / 16 int32)
            routing = [logits.new_empty(routes), x.new_empty(2 * routes, **i32), x.new_empty(4, routes // 16, **i32)]
            inter = x.new_empty(routes, self.inter)  # matmul_ogs with gather_indx, the SwiGLU fused: [routes, I]
            # matmul_ogs with scatter_indx and the gates, fused scatter: one [tokens + routes, H] buffer whose first
            # rows are the result (a view of it is returned), the rest the per-route scratchpad; two index tensors
            # for the write-back while it runs
            idx = [x.new_empty(routes, **i32), x.new_empty(tokens + routes + 1, **i32)]
            out = x.new_empty(tokens + routes, self.hidden)
            del inter, routing, idx
            return out[:tokens].reshape(batch, -1, self.hidden), logits

    return StandInMxfp4MLP


def mxfp4_standins(model) -> None:
    """Replace gpt-oss's MoE blocks by the MXFP4 stand-in, as transformers' replace_with_mxfp4_linear replaces
    every GptOssMLP."""
    cls = mxfp4_standin_class()
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "GptOssMLP":
            model.set_submodule(name, cls(module, model.config))


def lora_custom_modules() -> dict:
    """peft's LoRA layer for each stand-in peft cannot recognise by type (LoraConfig._register_custom_module): the
    GPTQ stand-in gets peft's own GPTQLoraLinear, which peft picks for gptqmodel's QuantLinear, and the AWQ one
    AwqLoraLinear."""
    from peft.tuners.lora.awq import AwqLoraLinear
    from peft.tuners.lora.gptq import GPTQLoraLinear
    return {prequantized_standin_class(): GPTQLoraLinear, awq_training_standin_class(): AwqLoraLinear}


@functools.cache
def peft_dequantizes_standins() -> None:
    """Let peft's dequantize_module_weight (DoRA's weight norm, at get_peft_model and in every forward) dequantize
    the stand-ins as it dequantizes bnb layers: 4-bit to its dtype (the compute dtype), 8-bit to fp32 (peft
    utils/integrations.py dequantize_bnb_weight). Other modules keep peft's own path."""
    import torch
    from peft.tuners.lora import dora

    StandIn4bit, StandIn8bit = standin_linear_classes()
    original = dora.dequantize_module_weight

    def dequantize_module_weight(module):
        if isinstance(module, StandIn4bit):
            return module.dequantize(module.compute_dtype)
        if isinstance(module, StandIn8bit):
            return torch.empty(module.out_features, module.in_features, dtype=torch.float32,
                               device=module.weight.device)
        return original(module)

    dora.dequantize_module_weight = dequantize_module_weight


def quantize_standins(model, names, setup: Setup, compute_dtype) -> None:
    """Replace the named nn.Linear/Conv1D modules by bitsandbytes stand-ins (4-bit or int8)."""
    import torch
    StandIn4bit, StandIn8bit = standin_linear_classes()
    if setup.use_dora:
        peft_dequantizes_standins()
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        src = getattr(parent, child)
        if type(src).__name__ == "Conv1D":  # GPT-2: weight [in, out]; bnb replaces it by a Linear [out, in]
            lin = torch.nn.Linear(src.weight.shape[0], src.weight.shape[1], bias=src.bias is not None,
                                  device="meta")
            lin.bias = src.bias
            src = lin
        if setup.quant == "awq" and setup.mode == "train":
            new = awq_training_standin_class()(src, setup.group_size)
        elif setup.quant == "fp8" and setup.mode == "train":
            new = fp8_training_standin_class()(src)
        elif setup.quant.startswith("torchao"):
            new = torchao_standin_class()(src, PREQUANTIZED[setup.quant], compute_dtype, setup.group_size)
        elif setup.quant in PREQUANTIZED:
            new = prequantized_standin_class()(src, setup.quant, training=setup.mode == "train",
                                               group_size=setup.group_size)
        elif setup.quant == "int8":
            new = StandIn8bit(src, compute_dtype)
        else:
            new = StandIn4bit(src, setup.quant, setup.double_quant, compute_dtype)
        setattr(parent, child, new)


class StandInBnbOptimizer:
    """bitsandbytes optimizer state (Optimizer1State/Optimizer2State.init_state, bnb 0.50): `states` per parameter
    (AdamW 2, Lion 1); 8-bit: uint8 states plus one fp32 absmax per 256 elements each, fp32 states for tensors
    below 4096 elements and for the parameters Trainer overrides to 32 bits (its nn.Embedding weights); 32-bit:
    fp32 states. The blockwise update is one fused kernel (no temporaries). Paged state is allocated in unified
    memory, outside torch's allocator."""

    def __init__(self, params, tracker, paged: bool, fp32=frozenset(), states: int = 2, bits: int = 8):
        self.params = [p for p in params if p.requires_grad]
        self.state: dict = {}
        self.tracker, self.paged = tracker, paged  # tracker: memplan.runtime.tracker.StorageTracker
        self.fp32, self.states, self.bits = fp32, states, bits

    def step(self):
        import torch
        for p in self.params:
            if p.grad is None:
                continue
            if p not in self.state:
                with self.tracker.paged() if self.paged else contextlib.nullcontext():
                    st = self._states(p, torch)
                for t in st:
                    self.tracker.tag(t, "optimizer_state")
                self.state[p] = st

    def _states(self, p, torch) -> list:
        n = p.numel()
        if self.bits == 32 or n < 4096 or id(p) in self.fp32:
            return [torch.zeros_like(p, dtype=torch.float32) for _ in range(self.states)]
        blocks = math.ceil(n / 256)
        return ([torch.zeros(n, dtype=torch.uint8, device=p.device) for _ in range(self.states)]
                + [torch.zeros(blocks, dtype=torch.float32, device=p.device) for _ in range(self.states)])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class StandInTorchaoAdamW(StandInBnbOptimizer):
    """torchao AdamW8bit / AdamW4bit as transformers builds them (block_size=256): tensors compat.torchao_quantized
    accepts get two quantized states (1 or 0.5 B per element) with an fp32 scale per block and a code table (256 or
    16 fp32); others keep plain states in the param dtype. Each step runs the compiled fp32 math per tensor: the
    buffers compat.TORCHAO_STEP_BUFFERS gives for a quantized one (fp32 states; 4-bit: their int64 codes too)."""

    def step(self):
        import torch
        from memplan.model.compat import TORCHAO_STEP_BUFFERS, torchao_quantized
        dtypes = {4: torch.float32, 8: torch.int64}  # a step buffer's bytes per element -> inductor's dtype
        for p in self.params:
            if p.grad is None:
                continue
            n = p.numel()
            quantized = torchao_quantized(n)
            if p not in self.state:
                if not quantized:
                    st = [torch.zeros_like(p) for _ in range(2)]
                else:
                    codes = 256 if self.bits == 8 else 16
                    st = [torch.zeros(n * self.bits // 8, dtype=torch.uint8, device=p.device) for _ in range(2)]
                    st += [torch.zeros(n // 256, dtype=torch.float32, device=p.device) for _ in range(2)]
                    st += [torch.zeros(codes, dtype=torch.float32, device=p.device) for _ in range(2)]
                for t in st:
                    self.tracker.tag(t, "optimizer_state")
                self.state[p] = st
            if quantized:  # inductor's separate buffers (fp32 states; 4-bit: int64 codes too), as many blocks
                _work = [torch.empty(n, dtype=dtypes[size], device=p.device)
                         for size in TORCHAO_STEP_BUFFERS[self.bits]]


class StandInScheduleFree(StandInBnbOptimizer):
    """schedulefree.AdamWScheduleFree: z (a copy of the parameter) and exp_avg_sq per tensor, in the param dtype;
    the foreach step's `denom` is one buffer over the whole group."""

    def step(self):
        import torch
        for p in self.params:
            if p.grad is not None and p not in self.state:
                self.state[p] = [torch.clone(p).detach(), torch.zeros_like(p)]
                for t in self.state[p]:
                    self.tracker.tag(t, "optimizer_state")
        _denom = [torch.empty_like(p) for p in self.params if p.grad is not None]
