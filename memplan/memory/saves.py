"""What single ops save for backward: a Linear's input (only when its weight trains), a LoRA branch, an activation
function, a normalisation layer. memplan.memory.activations adds them up per block (its docstring has the counting
rule, from torch's tools/autograd/derivatives.yaml)."""
from __future__ import annotations

from memplan.memory.context import Ctx


#: activation -> bytes saved per element of its input, as f(c) for compute bytes c; `mixed` variant under autocast.
#: gelu/silu/relu (one ATen op): the input (or output) only. gelu_new (transformers NewGELUActivation, five python
#: ops): pow saves x, tanh saves its output, the final mul saves 0.5*x and (1+tanh); under autocast pow runs in fp32
#: (autocast fp32 op list) so x is upcast and the tanh chain is fp32.
ACT_SAVED = {
    "gelu_new": (lambda c: 4 * c, lambda c: 4 + 4 + c + 4),
    "default": (lambda c: c, lambda c: c),
}
#: activations whose backward needs their output (aten threshold_backward for relu): that output is also fc2's
#: input, so a trainable fc2 adds nothing when no dropout sits between them.
SAVES_OUTPUT = {"relu"}


def act_saved_bytes(ctx: Ctx) -> float:
    pure, mixed = ACT_SAVED.get(ctx.spec.arch.hidden_act, ACT_SAVED["default"])
    return (mixed if ctx.mixed else pure)(ctx.act_bytes)


def weight_trains(ctx: Ctx, name: str) -> bool:
    return name + ".weight" in ctx.trainable


def input_saves(ctx: Ctx, members, in_dim: int, in_bytes: int, lora_names: set[str]) -> float:
    """Bytes per token saved for a group of Linears reading one shared input of `in_dim` elements: the trained
    Linears' inputs (one cast copy each under autocast, else the shared tensor once) plus each LoRA branch."""
    c = ctx.act_bytes
    cast = in_bytes != c
    trained = sum(1 for m in members if weight_trains(ctx, m.name))
    shared_saved = trained > 0 and not cast
    saved = (trained * in_dim * c if cast else in_dim * c) if trained else 0.0
    for m in members:
        if m.name in lora_names:
            branch, shares_input = lora_saves(ctx, in_dim, in_bytes)
            saved += branch
            if shares_input and not shared_saved:
                saved += in_dim * in_bytes  # the shared input itself, saved once by the first lora_A
                shared_saved = True
    return saved


def lora_saves(ctx: Ctx, in_dim: int, in_bytes: int) -> tuple[float, bool]:
    """One LoRA branch -> (bytes per token, whether it saves the layer's own input tensor instead of a copy).

    peft casts x to the fp32 adapter dtype (lora/layer.py Linear.forward `_cast_input_dtype`), or under autocast
    lora_A casts it to the compute dtype: a copy per branch that lora_A saves. An fp32 input with no dropout is
    saved as is (shared by all branches on that input). lora_B saves [t, r]. Dropout > 0 adds a 1-byte mask and
    a dropped copy per branch."""
    s = ctx.setup
    xb = ctx.compute_bytes if ctx.mixed else 4
    own_copy = ctx.mixed or in_bytes != 4 or s.lora_dropout > 0
    x = in_dim * xb if own_copy else 0.0
    if s.lora_dropout > 0:
        x += in_dim
    return x + s.lora_r * xb, not own_copy


#: RMSNorms that multiply the *input* (not its fp32 upcast) by rsqrt(variance): T5LayerNorm
#: (`hidden_states * torch.rsqrt(variance + eps)` after computing the variance from `hidden_states.to(float32)`),
#: so a 16-bit model saves the input as well as its fp32 copy.
RMS_KEEPS_INPUT = {"t5", "mt5"}
#: RMSNorms that apply the weight in fp32 and cast after (`output * (1.0 + self.weight.float())`, GemmaRMSNorm;
#: `(self.weight * hidden_states).to(input_dtype)`, Olmo2RMSNorm): the normalised tensor a trainable weight needs is
#: fp32 whatever the model dtype. Read from the norm's code when the inventory is built (Arch.norm_weight_fp32).
#: LayerNorms written out in fp32 that centre the input twice (modeling_cohere.py CohereLayerNorm: `(hidden_states -
#: mean).pow(2)` for the variance and `(hidden_states - mean) * torch.rsqrt(...)`, then `weight.float() * ...`): pow
#: and the product each save their own fp32 centred copy, and a trainable weight the fp32 normalised tensor. Found by
#: the tracer: a Cohere-shaped config 1.5 MiB per block above the estimate (LoRA all-linear bf16 b2 s256, -2.5%).
CENTRED_FP32_LAYERNORM = {"cohere"}


def norm_bytes(ctx: Ctx, h: int, trains: bool, model_type: str = "") -> float:
    """RMSNorm (HF Llama style: upcast to fp32, x*rsqrt(var), weight * x.to(dtype)): saves the fp32 input and,
    when the weight trains, the normalised tensor. LayerNorm (ATen native_layer_norm): saves its input (+ [t] stats);
    Cohere's fp32 LayerNorm two centred fp32 copies (CENTRED_FP32_LAYERNORM)."""
    r = ctx.residual_bytes
    if ctx.spec.arch.norm == "rmsnorm":
        mt = model_type or ctx.spec.arch.model_type
        keeps = mt in RMS_KEEPS_INPUT and r != 4
        normed = 4 if ctx.spec.arch.norm_weight_fp32 else r
        return 4 * h + (normed * h if trains else 0) + (r * h if keeps else 0)
    if (model_type or ctx.spec.arch.model_type) in CENTRED_FP32_LAYERNORM:
        return 8 * h + (4 * h if trains else 0) + 8
    return r * h + 8
