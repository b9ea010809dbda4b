"""DoRA's weight-sized forward temporaries (peft lora/dora.py DoraLinearLayer, peft 0.21).

Each DoRA layer's forward rebuilds the norm of W + s*BA over the whole weight: lora_weight comes from
lora_B(lora_A(I)) on an [in, in] identity (get_lora_weight: built so under FSDP), the base weight is cast (or, when
quantized, dequantized) to x's dtype, and get_weight_norm adds the scaled product before the row norms. The norm is
detached, so none of this is saved for backward except what lora_A saves of the identity for its weight gradient,
which lives as long as lora_weight does (to the end of the layer's forward). One layer's set exists at a time: the
largest is what the step's forward (and a checkpointed recompute) holds on top of the saved activations.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory.saves import branch_bytes


@per_model("lora_r")
def dora_temp_bytes(ctx: Ctx) -> int:
    """Bytes of the largest DoRA layer's forward temporaries (module docstring); 0 without DoRA."""
    if not (ctx.setup.use_dora and ctx.setup.uses_lora):
        return 0
    return max((layer_temp_bytes(ctx, m.in_features, m.out_features, m.name in ctx.quantized) for m in ctx.lora),
               default=0)


def layer_temp_bytes(ctx: Ctx, n_in: int, n_out: int, quantized: bool) -> int:
    """One DoRA layer's temporaries at get_weight_norm, its largest moment.

    xb: the dtype x reaches the layer in, which lora_A and lora_B compute in: the adapter's (fp32: peft's
    autocast_adapter_dtype) outside autocast, the compute dtype under it (where lora_A saves a compute-dtype copy
    of the identity). Alive at once: the identity lora_A saved [in, in], lora_A's output [in, r], lora_weight
    [out, in], the base weight cast or dequantized to xb (none when it already is xb), s * lora_weight and
    W + s * lora_weight.
    """
    xb = branch_bytes(ctx)
    w = n_out * n_in
    eye = (n_in * n_in + n_in * ctx.setup.lora_r) * xb
    base = w * xb if (quantized or ctx.weight_bytes != xb) else 0
    return int(eye + w * xb + base + 2 * w * xb)
