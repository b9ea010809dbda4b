"""What a model's MLP activation function saves for backward and returns, measured on fake tensors when its
inventory is built (memplan.inventory.probes.read).

Python compositions (gelu_new, xIELU) keep intermediates that one ATen op does not, and under CUDA autocast their
fp32 ops change what they keep and return. Every probe returns its default when the activation cannot run on fake
tensors.
"""
from __future__ import annotations

import functools

from memplan.model.spec import ACT_CASES
from memplan.runtime.emulate.autocast import cuda_autocast_fp32


def act_saves(name: str) -> tuple[float, ...]:
    """Bytes per input element that the activation `name` (transformers ACT2FN) saves for backward, input included.

    One ATen op (silu, gelu, relu) saves its input only; Python compositions keep their intermediates: gelu_new 4
    tensors (8/16/14/16 bytes: pow runs in fp32 under CUDA autocast), gelu_fast 7, quick_gelu 2, Apertus' xIELU
    7/13/11/13 with its alphas frozen, 9/17/15/17 trained (they train with a fully trained MLP).

    Measured by running it on fake CPU tensors under saved_tensors_hooks, per ACT_CASES: 16-bit and fp32 input,
    without and with autocast (CUDA autocast's fp32 ops, memplan.runtime.emulate.autocast; an fp32 input under
    autocast is QLoRA's, whose bitsandbytes layers return fp32), its own parameters frozen or trained.

    Returns:
        One value per ACT_CASES entry; () for a name ACT2FN does not know.
    """
    return tuple(saved for saved, _ in _measure(name))


def act_out_bytes(name: str) -> tuple[float, ...]:
    """Bytes per element of what the activation `name` returns, per ACT_CASES.

    Under CUDA autocast a Python composition whose fp32 op (gelu_new's pow) promotes the result returns fp32 from a
    16-bit input, which a gated MLP's product then saves (T5 v1.1, flan-t5, mT5, UMT5: `hidden_gelu * hidden_linear`).
    Measured like act_saves; () where act_saves is.
    """
    return tuple(out for _, out in _measure(name))


@functools.lru_cache(maxsize=32)
def _measure(name: str) -> tuple[tuple[float, float], ...]:
    """(bytes saved per input element, bytes per output element) per ACT_CASES; () where it cannot run."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        return ()
    rows, width = 8, 64
    out = []
    for trains, dtype, mixed in ACT_CASES:
        fn = ACT2FN[name]  # a fresh module: its own small parameters (xIELU's alphas) in the model's dtype
        if isinstance(fn, torch.nn.Module):
            fn = fn.to(getattr(torch, dtype)) if not mixed else fn
            for p in fn.parameters():
                p.requires_grad_(trains)
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            if t.dim() and t.shape[0] == rows:
                saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.empty(rows, width, dtype=getattr(torch, dtype), requires_grad=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed), cuda_autocast_fp32(), \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = fn(x)
        except Exception:  # e.g. PReLU's weight promotion: the one-op rule (memplan.estimator.memory.saves)
            return ()
        out.append((sum(saved.values()) / (rows * width), float(y.element_size())))
    return tuple(out)
