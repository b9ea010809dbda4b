"""What single ops save for backward: a Linear's input, a LoRA branch, an activation function, a norm.

A Linear saves its input only when its weight trains. memplan.estimator.memory.activations adds them up per block
(its docstring has the counting rule, from torch's tools/autograd/derivatives.yaml).
"""
from __future__ import annotations

from memplan.model.spec import act_case, norm_case
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.recording import gradless_linears


#: activations whose backward needs their output (aten threshold_backward for relu): that output is also fc2's
#: input, so a trainable fc2 adds nothing when no dropout sits between them.
SAVES_OUTPUT = {"relu"}


def act_saved_bytes(ctx: Ctx, trains: bool = False) -> float:
    """Bytes per element of its input the MLP activation saves.

    Measured on the family's activation when its inventory was built (Arch.act_saves, codefacts.act_saves; under
    autocast over FSDP's 16-bit parameters the 16-bit autocast case), else one ATen op's (its input).
    trains: the activation's own parameters, if any, train with the MLP.
    """
    table, c = ctx.spec.arch.act_saves, ctx.act_bytes
    if not table:
        return c
    return table[act_case(trains, ctx.autocast, c)]


def act_out_bytes(ctx: Ctx, trains: bool = False) -> float:
    """Bytes per element the MLP activation returns: Arch.act_out where measured, else the activations' dtype.

    gelu_new under autocast returns fp32.
    """
    table, c = ctx.spec.arch.act_out, ctx.act_bytes
    return table[act_case(trains, ctx.autocast, c)] if table else c


def weight_trains(ctx: Ctx, name: str) -> bool:
    return name + ".weight" in ctx.trainable


#: bytes per element of the input an AWQ layer saves: gptqmodel's AwqGEMMLinear casts a non-16-bit input to fp16
AWQ_INPUT_BYTES = 2


def awq_saves(ctx: Ctx, name: str) -> bool:
    """The Linear is an AWQ layer of a LoRA run, whose kernel saves its fp16 input whatever trains (gptqmodel
    qlinear/gemm_awq.py AwqGemmFn.forward: ctx.save_for_backward(x, ...)). Not where that input carries no gradient
    (recording.gradless_linears): nothing records a graph there."""
    return (ctx.setup.quant == "awq" and ctx.training and name in ctx.quantized
            and name not in gradless_linears(ctx))


def awq_input_bytes(ctx: Ctx, members, in_dim: int, in_bytes: int) -> float:
    """Bytes per token the AWQ layers among `members` save of their shared `in_dim` input: a cast copy each, or the
    16-bit input itself once."""
    n = sum(1 for m in members if awq_saves(ctx, m.name))
    return in_dim * AWQ_INPUT_BYTES * (1 if in_bytes == AWQ_INPUT_BYTES else n) if n else 0.0


def input_saves(ctx: Ctx, members, in_dim: int, in_bytes: int, lora_names: set[str]) -> float:
    """Bytes per token saved for a group of Linears reading one shared input of `in_dim` elements.

    The trained Linears' inputs (one cast copy each under autocast, else the shared tensor once) plus each LoRA
    branch. A transformers-5 router peft adapts (kind "router": its ParamWrapper makes W + BA, which F.linear then
    applies) saves its input as a trained one does, with no branch of its own.
    """
    c = ctx.act_bytes
    cast = in_bytes != c
    trained = sum(1 for m in members if weight_trains(ctx, m.name) or m.kind == "router" and m.name in lora_names)
    shared_saved = trained > 0 and not cast
    saved = (trained * in_dim * c if cast else in_dim * c) if trained else 0.0
    for m in members:
        if m.name in lora_names and m.kind != "router":
            branch, shares_input = lora_saves(ctx, in_dim, in_bytes, m)
            saved += branch
            if shares_input and not shared_saved:
                saved += in_dim * in_bytes  # the shared input itself, saved once by the first lora_A
                shared_saved = True
    return saved + awq_input_bytes(ctx, members, in_dim, in_bytes)


def shared_input_saves(ctx: Ctx, members, in_dim: int, in_bytes: int, lora_names: set[str]) -> float:
    """The part of input_saves that is the shared input tensor itself, not a cast copy nor a branch's own.

    It is one storage, however many Linears in however many blocks read it.
    """
    c = ctx.act_bytes
    if in_bytes == c and any(weight_trains(ctx, m.name) for m in members):
        return in_dim * c
    if any(m.name in lora_names and lora_saves(ctx, in_dim, in_bytes)[1] for m in members):
        return in_dim * in_bytes
    if in_bytes == AWQ_INPUT_BYTES:
        return awq_input_bytes(ctx, members, in_dim, in_bytes)
    return 0.0


def lora_saves(ctx: Ctx, in_dim: int, in_bytes: int, m=None) -> tuple[float, bool]:
    """What one LoRA branch saves for backward.

    peft casts x to the fp32 adapter dtype (lora/layer.py Linear.forward `_cast_input_dtype`), or under autocast
    lora_A casts it to the compute dtype: a copy per branch that lora_A saves. An fp32 input with no dropout is
    saved as is (shared by all branches on that input). lora_B saves [t, r]. Dropout > 0 adds a 1-byte mask and
    a dropped copy per branch. DoRA (dora_saves) adds two [t, out] tensors of the Linear `m`.

    Returns:
        (bytes per token, whether it saves the layer's own input tensor instead of a copy).
    """
    s = ctx.setup
    xb = branch_bytes(ctx)
    own_copy = ctx.mixed or in_bytes != xb or s.lora_dropout > 0
    x = in_dim * xb if own_copy else 0.0
    if s.lora_dropout > 0:
        x += in_dim
    return x + s.lora_r * xb + (dora_saves(ctx, m, in_bytes) if m is not None else 0.0), not own_copy


def dora_saves(ctx: Ctx, m, in_bytes: int) -> float:
    """Bytes per token the DoRA layer on Linear `m` saves beyond its LoRA branch (peft lora/dora.py
    DoraLinearLayer.forward).

    result = (m / ||W + sBA|| - 1) * base_result + (m / ||W + sBA||) * lora_result * s: the two products save
    base_result (the base layer's output: in the compute dtype under autocast, else the activations' dtype; a
    bitsandbytes layer returns its input's dtype) and lora_result (lora_B's output, in the dtype x was cast to) for
    the magnitude's gradient. The norm is detached (DoRA section 4.3), so no weight-sized tensor is saved. Traced on
    SmolLM2-135M: 3, 2 and 2 [t, out] units of the compute dtype's width in bf16, bf16-mixed and fp32; QLoRA bf16
    on Qwen2.5-0.5B: 4 (fp32 base outputs over the fp32 residual stream of prepare_model_for_kbit_training).
    """
    if not ctx.setup.use_dora:
        return 0.0
    lora = branch_bytes(ctx)
    if ctx.setup.lora_dropout > 0:
        # no base_result with dropout: F.linear(dropout(x), W cast to x's dtype) recomputes it (its weight:
        # dora_dropout_weight_bytes); under autocast F.linear also saves a compute-dtype copy of x
        x_copy = m.in_features * ctx.compute_bytes if ctx.mixed and lora != ctx.compute_bytes else 0
        return m.out_features * 2 * lora + x_copy
    if m.name in ctx.quantized:
        base = in_bytes
    else:
        base = ctx.compute_bytes if ctx.mixed else ctx.act_bytes
        if m.bias:  # base_result - bias: promoted to the bias's dtype (an fp32 bias under autocast)
            base = max(base, ctx.weight_bytes)
    return m.out_features * (base + lora)


def dora_dropout_weight_bytes(ctx: Ctx, linears, lora_names: set[str]) -> int:
    """Bytes of base weights DoRA saves per block when lora_dropout > 0 (peft dora.py: without base_result the
    layer recomputes F.linear(x, W) with W dequantized and cast to x's dtype, and the matmul saves that weight; a
    weight already in that dtype is saved as itself). Under autocast the saved weight is its compute-dtype cast."""
    s = ctx.setup
    if not (s.use_dora and s.lora_dropout > 0):
        return 0
    xb = branch_bytes(ctx)
    total = 0
    for m in linears:
        if m.name in lora_names and (m.name in ctx.quantized or ctx.weight_bytes != xb):
            total += m.in_features * m.out_features * xb
    return total


def adapter_compute_bytes(ctx: Ctx) -> int:
    """Bytes per element of the LoRA weights as the step computes with them.

    fp32 (peft's autocast_adapter_dtype), but 16-bit under an engine that runs the module in 16 bit (FSDP's
    MixedPrecisionPolicy param_dtype, DeepSpeed's bf16/fp16 module cast), where x needs no fp32 copy.
    """
    return ctx.compute_bytes if ctx.setup.engine in ("fsdp", "deepspeed") else ctx.adapter_bytes


def branch_bytes(ctx: Ctx) -> int:
    """Bytes per element a LoRA branch computes in (x's copy for lora_A, lora_A's and lora_B's outputs): autocast's
    compute dtype, else the adapters' (adapter_compute_bytes: fp32 adapters over a 16-bit model make an fp32
    branch)."""
    return ctx.compute_bytes if ctx.mixed else adapter_compute_bytes(ctx)


def liger_patched(ctx: Ctx) -> bool:
    """The training step runs Liger's RMSNorm and gated-MLP kernels (use_liger_kernel; the model types
    model.compat.LIGER_ESTIMATED, whose residual-stream norms and gate/up/down MLPs its patch replaces)."""
    return ctx.setup.use_liger_kernel and ctx.training


def liger_head(ctx: Ctx) -> bool:
    """Liger's fused linear cross-entropy replaces the head and the loss (use_liger_kernel, training a causal LM
    with labels: liger_kernel/transformers/model/*.py lce_forward skips the logits); not under TRL's trainers."""
    a = ctx.spec.arch
    # TRL's trainers set fused_linear_cross_entropy=False and score through their own head (memory.fused_head)
    return liger_patched(ctx) and a.kind == "causal" and a.has_lm_head and ctx.setup.trainer == "hf"


def norm_bytes(ctx: Ctx, h: int, trains: bool, rows: int = 1, in_bytes: int | None = None) -> float:
    """Bytes per token a normalisation layer of width h saves for backward.

    Measured on the family's own norm when its inventory was built (Arch.norm_saves, codefacts.norm_saves), indexed
    by the residual stream's dtype and whether the weight trains. Without a measurement (a hand-built spec): Llama's
    RMSNorm for an RMSNorm (an fp32 copy, rsqrt's fp32 output per row, the normalised tensor in the stream's dtype
    when the weight trains), else ATen native_layer_norm's (its input plus fp32 mean and rstd per row).
    rows: how many normalised rows a token has (the heads of a per-head q/k norm). in_bytes: the input's dtype where
    it is not the residual stream's (a q/k norm reads its projection's output, in the compute dtype under autocast).
    """

    r = ctx.residual_bytes if in_bytes is None else in_bytes
    if in_bytes is None and liger_patched(ctx):  # LigerRMSNorm: X in its dtype and an fp32 rstd per row
        return r * h + 4 * rows
    table = ctx.spec.arch.norm_saves
    # a q/k norm's or an inner norm's 16-bit input: an fp32 copy, not the input itself (the residual stream's norms
    # keep the measured rule: over FSDP's 16-bit parameters there is no such copy)
    if in_bytes is not None and autocast_casts_norm_input(ctx, r, trains):
        return 4 * h + table[norm_case(r, trains)][1] * rows
    if not table:
        if ctx.spec.arch.norm == "rmsnorm":
            return 4 * h + (r * h if trains else 0) + 4 * rows
        return r * h + 8 * rows
    per_element, per_row = table[norm_case(r, trains)][:2]
    return per_element * h + per_row * rows


def autocast_casts_norm_input(ctx: Ctx, in_bytes: int, trains: bool) -> bool:
    """Autocast casts a 16-bit input to fp32 before the norm.

    aten layer_norm is on autocast's fp32 list, and a norm that saves its input alone is one (nn.LayerNorm:
    Arch.norm_saves with the input as its only per-element save); a family's own norm upcasts by itself, as measured.
    """
    table = ctx.spec.arch.norm_saves
    if not (ctx.autocast and in_bytes < 4 and table and len(table[0]) > 2):
        return False
    per_element, _, own = table[norm_case(in_bytes, trains)][:3]
    return own > 0 and own == per_element


def norm_keeps_input(ctx: Ctx, trains: bool) -> bool:
    """The normalisation layer saves its input tensor itself, not a copy.

    LayerNorm always, an RMSNorm whose fp32 cast is a no-op (an fp32 stream), T5's norm, which multiplies the input
    itself (Arch.norm_saves' third value, measured; without it, those rules). Under checkpointing the block's input
    norm then saves the checkpoint input, already alive, not a tensor of its own.
    """
    r = ctx.residual_bytes
    table = ctx.spec.arch.norm_saves
    if table and len(table[0]) > 2:
        return table[norm_case(r, trains)][2] > 0
    return ctx.spec.arch.norm != "rmsnorm" or r == 4
