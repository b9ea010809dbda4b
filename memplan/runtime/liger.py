"""Liger Kernel stand-ins (use_liger_kernel): Liger's Triton kernels cannot run on the CPU, so these autograd
Functions allocate and save what the kernels do (linkedin/Liger-Kernel v0.8.2, read at ead96b6), patched into the
model instance as Liger's apply_liger_kernel_to_* patches it (transformers' Trainer calls it at train()):

- fused linear cross-entropy (ops/fused_linear_cross_entropy.py): no logits tensor. Forward allocates grad_input
  [BT, H] (zeros_like the hidden states), grad_weight [V, H] when the head trains, and per chunk of C rows a [C, V]
  logits block the kernel overwrites with its gradient, a [C, H] slice of grad_input, and for a 16-bit grad_weight
  the [V, H] mm result and its fp32 copy (`grad_weight += torch.mm(...).float()`); an fp32 grad_weight accumulates in
  place (addmm with out_dtype). C = next_pow2(ceil(BT / ceil(V / H))). Only grad_input and grad_weight are saved;
  backward scales them in place.
- RMSNorm (ops/rms_norm.py): saves X (its own dtype), W and an fp32 rstd per row; backward writes dX into dY in
  place (Llama casting) or into a new tensor (Gemma-2/3: in_place=False), and sums a [SMs, H] fp32 dW buffer.
- SwiGLU / GEGLU MLP (ops/swiglu.py, ops/geglu.py): saves gate and up only (the activation is recomputed in backward)
  and writes their gradients into them in place.
RoPE is left as transformers runs it: Liger's saves the same cos/sin (its gain is temporaries only).
Lazy torch: nothing is imported at module import.
"""
from __future__ import annotations

import functools
import math

#: streaming multiprocessors of the card dW's partial sums are laid out for (H100 SXM: 132)
SM_COUNT = 132

#: norms Liger's patch functions swap per decoder layer (monkey_patch.py apply_liger_kernel_to_llama ...), and the
#: final norm
PATCHED_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")


@functools.cache
def _functions():
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, in_place):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).contiguous()
            y = torch.empty_like(x2)
            rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
            ctx.in_place = in_place
            ctx.save_for_backward(x2, weight, rstd)
            return y.view(shape)

        @staticmethod
        def backward(ctx, dy):
            x2, weight, rstd = ctx.saved_tensors
            dx = dy if ctx.in_place else torch.zeros_like(dy)
            dw = None
            if weight is not None and ctx.needs_input_grad[1]:
                partial = torch.empty(SM_COUNT, x2.shape[-1], dtype=torch.float32, device=dy.device)
                dw = partial.sum(0).to(weight.dtype)
            return dx, dw, None

    class GatedAct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors
            return a, b  # da, db written into a and b

    class FusedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            bt, h = x.shape
            v = weight.shape[0]
            grad_input = torch.zeros_like(x)
            grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
            loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
            _mask = torch.empty(bt, dtype=torch.bool, device=x.device)
            chunk = min(2 ** math.ceil(math.log2(max(1, math.ceil(bt / math.ceil(v / h))))), bt)
            for start in range(0, bt, chunk):
                xc = x[start:start + chunk]
                logits = xc @ weight.t()  # the kernel writes d(loss)/d(logits) into it
                grad_input[start:start + chunk] = logits @ weight
                if grad_weight is not None:
                    if grad_weight.dtype == torch.float32:  # addmm(out_dtype=fp32, out=grad_weight): no temporary
                        grad_weight.add_(torch.empty((), dtype=torch.float32, device=x.device))
                    else:
                        grad_weight += torch.mm(logits.t(), xc.to(logits.dtype)).float()
                del logits
            loss = loss_1d.sum()
            ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
            ctx.leaf = weight if weight.is_leaf and weight.requires_grad else None
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            grad_input, grad_weight = ctx.saved_tensors  # scaled in place by grad_loss
            if ctx.leaf is not None and ctx.leaf.grad is None and grad_weight is not None:
                # On CUDA autograd adds a tied embedding's contribution into this buffer in place (input_buffer.cpp
                # accumulate); never into a tensor subclass such as the tracer's fake tensors. Handing the buffer
                # over as .grad makes AccumulateGrad add it in place here too: the same tensors, the same peak.
                ctx.leaf.grad = grad_weight
                return grad_input, None
            return grad_input, grad_weight

    return RMSNorm, GatedAct, FusedLinearCrossEntropy


def apply_liger_standins(model, gated_act_names=("gate_proj", "up_proj", "down_proj"), head: bool = True) -> None:
    """Patch `model` (a causal LM, or the peft model around one) as Liger's default patch does: the decoder
    layers' RMSNorms and the final norm, the gated MLPs, and (head) the causal LM's forward (fused linear
    cross-entropy when training with labels); TRL's trainers pass fused_linear_cross_entropy=False: no head."""
    import torch.nn.functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast

    RMSNorm, GatedAct, FLCE = _functions()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    in_place = base.config.model_type not in ("gemma2", "gemma3", "gemma3_text")
    inner = base.get_decoder() if hasattr(base, "get_decoder") else base.model

    for name, module in inner.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in PATCHED_NORMS or name == "norm":
            module.forward = _norm_forward(module, RMSNorm, in_place)
        if short == "mlp" and all(hasattr(module, n) for n in gated_act_names):
            module.forward = _mlp_forward(module, GatedAct)
    if not head:
        return
    original = base.forward

    def forward(input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None or not base.training:
            return original(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        kwargs.pop("num_items_in_batch", None)
        out = base.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out[0]
        _shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # labels shift, not the hidden states
        loss = FLCE.apply(hidden.reshape(-1, hidden.shape[-1]), base.lm_head.weight)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    base.forward = forward


def _norm_forward(module, fn, in_place: bool):
    def forward(x):
        return fn.apply(x, module.weight, in_place)
    return forward


def _mlp_forward(module, fn):
    def forward(x):
        return module.down_proj(fn.apply(module.gate_proj(x), module.up_proj(x)))
    return forward


def apply_liger_kernels(model, head: bool = True) -> None:
    """Patch `model` with Liger's own kernels, as Trainer.train() does (transformers integrations/liger.py: the peft
    model's base, default kernel config; TRL's trainers without the fused cross-entropy: head=False). For CUDA runs;
    the tracer uses apply_liger_standins."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        from memplan.errors import BadInput
        raise BadInput("use_liger_kernel on a GPU runs Liger's Triton kernels: pip install liger-kernel") from None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(model=base, **({} if head else {"fused_linear_cross_entropy": False}))
