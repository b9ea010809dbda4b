"""What a block saves after its attention core, per token.

The output projection's saves, the norms that follow the attention, the MLP (dense, gated or MoE) and the residual
dropouts' masks; memplan.estimator.memory.activations adds the attention side. Backward frees this part of a block
before it reaches the block's attention core (the autograd engine runs nodes in reverse creation order), which the
attention's backward peak relies on (phases attention_backward, block_ends.attention_backward_freed_bytes).
"""
from __future__ import annotations

from memplan.estimator.memory.attention import kernel_bytes, padded_masks
from memplan.estimator.memory.context import Ctx
from memplan.model.layout import BlockLayout
from memplan.estimator.memory.moe import expert_params, moe_bytes, routers
from memplan.estimator.memory.saves import (AWQ_INPUT_BYTES, SAVES_OUTPUT, act_out_bytes, act_saved_bytes, awq_saves,
                                            input_saves, liger_patched, lora_saves, norm_bytes, weight_trains)


def norms_after_attention(ctx: Ctx, blk: BlockLayout) -> int:
    """How many of the block's hidden-size norms run after its last attention core.

    Post-LN blocks: every norm. Pre-LN blocks: all but the input norm (Gemma's post-attention and feed-forward
    norms), a decoder's cross-attention keeping the norm before it. None in parallel blocks (attention and MLP read
    one normed input).
    """
    a = ctx.spec.arch
    if a.parallel_block:
        return 0
    cross = blk.stack == "decoder" and a.kind == "seq2seq"
    return max(blk.norms - (0 if a.post_norm else 1) - cross, 0)


def mlp_readers(by_slot: dict) -> list:
    """The Linears that read the MLP's input: mlp_in and a gate beside the MLP (layout "mlp_gate")."""
    # one group, so that a LoRA on the gate keeps its own fp32 copy and a trained one shares the 16-bit input
    return by_slot.get("mlp_in", []) + by_slot.get("mlp_gate", [])


def post_attention_bytes(ctx: Ctx, blk: BlockLayout, lora_names: set[str], block_trains: bool, kernel: str) -> float:
    """Bytes per token a block saves after its (last) attention core.

    The output projection's saves, the norms after the attention (norms_after_attention), the MLP or MoE and the
    residual dropouts' masks. Backward frees them before it reaches that attention's core (the engine runs nodes in
    reverse creation order), so the attention's backward peak (phases attention_backward) no longer holds them.
    """
    a = ctx.spec.arch
    c, h = ctx.act_bytes, a.hidden_size
    by_slot = blk.by_slot()
    eager = kernel != "fused" or fused_output_copied(ctx)  # the attention's output is not the kernel's saved one
    per_tok = norms_after_attention(ctx, blk) * norm_bytes(ctx, h, block_trains)
    if not (a.parallel_block and blk.norms == 1):
        # a transformers-5 router's F.linear reads the same normed input
        group = routers(ctx, blk)
        own = a.router_copy if ctx.residual_bytes == 2 and not ctx.autocast else 0.0
        if own:  # a router that upcasts a 16-bit input saves that copy, not the shared input (DeepSeek-V3)
            per_tok += own * h * sum(1 for m in group if weight_trains(ctx, m.name) or m.name in lora_names)
            group = []
        per_tok += input_saves(ctx, mlp_readers(by_slot) + group, h, ctx.residual_bytes, lora_names)
    for m in by_slot.get("attn_out", []):
        saved_input = eager and weight_trains(ctx, m.name)
        per_tok += m.in_features * c if saved_input else 0  # the attention's output (MLA: heads x v_head_dim)
        # an AWQ layer saves its 16-bit input (autocast's kernel output): the fused kernel's saved output itself
        per_tok += m.in_features * AWQ_INPUT_BYTES if eager and awq_saves(ctx, m.name) else 0
        if m.name in lora_names:
            branch, shares = lora_saves(ctx, m.in_features, c, m)
            # sdpa's output is already saved by the attention; eager's contiguous copy is not unless o trains
            per_tok += branch + (m.in_features * c if shares and eager and not saved_input else 0)
    experts = expert_params(ctx, blk)
    per_tok += moe_bytes(ctx, experts, lora_names) if experts else mlp_bytes(ctx, by_slot, lora_names)
    if experts and by_slot.get("mlp_in"):  # a shared expert beside the routed ones (Qwen2-MoE, DeepSeek-V3)
        per_tok += mlp_bytes(ctx, by_slot, lora_names, shared=True)
        # Qwen2-MoE gates it by a sigmoid (shared_expert_gate): the product keeps the shared expert's output;
        # DeepSeek-V3 and dots1 add it ungated
        per_tok += a.hidden_size * c if by_slot.get("mlp_gate") else 0
    if a.hidden_dropout > 0:  # one bool mask per residual dropout (attention and MLP outputs; DistilBERT's MLP alone)
        per_tok += (a.residual_dropouts or 2) * h
    return per_tok


def fused_output_copied(ctx: Ctx) -> bool:
    """The output projection reads (and, trained, saves) a copy of the fused kernel's output, not the saved output.

    The flash kernel's output comes out heads-first, laid out like q, where q reaches it as a new heads-first tensor
    (Arch.attn_out_copy: a concatenated partial rotary), and sdpa_attention_forward's `transpose(1, 2).contiguous()`
    copies it. CUDA runs flash for 16-bit q/k/v of one head size without an explicit mask; the efficient kernel it
    runs otherwise (MLA's other value size, fp32, padded batches) writes [b, s, h, d] whatever q's layout, so its
    output transposes back contiguous.
    """
    a = ctx.spec.arch
    return a.attn_out_copy and a.v_ratio == 1 and kernel_bytes(ctx) == 2 and not padded_masks(ctx)


def mlp_bytes(ctx: Ctx, by_slot: dict, lora_names: set[str], shared: bool = False) -> float:
    """What the MLP saves per token (mlp_parts)."""
    return sum(mlp_parts(ctx, by_slot, lora_names, shared))


def mlp_out_bytes(ctx: Ctx, blk: BlockLayout, lora_names: set[str]) -> float:
    """Per token, what a dense MLP's output projection saves (mlp_parts' second part); 0 for MoE blocks.

    Its backward frees it before the product's backward, the MLP's largest moment (phases._backward_temp_bytes).
    """
    if expert_params(ctx, blk):
        return 0.0
    return mlp_parts(ctx, blk.by_slot(), lora_names)[1]


def mlp_parts(ctx: Ctx, by_slot: dict, lora_names: set[str], shared: bool = False) -> tuple[float, float]:
    """What the MLP saves per token, split at its output projection.

    Gated (SwiGLU/GeGLU) saves gate, act(gate), up and, if down trains, their product; plain MLPs save the
    activation's inputs (saves.act_saved_bytes) and, if fc2 trains, its input. MoE multiplies by top-k (each token
    visits k experts) and adds the gathered expert inputs/outputs. shared: a MoE block's shared expert (every token,
    its own width: Qwen2-MoE's shared_expert_intermediate_size; the sigmoid gate's product is the caller's).

    Returns:
        (saved per token up to the output projection, what the output projection saves: its input and LoRA branch).
    """
    a = ctx.spec.arch
    c, I = ctx.act_bytes, a.intermediate_size
    outs = by_slot.get("mlp_out", [])
    # experts as Linears (transformers 4), not a dense MLP in an MoE model (DeepSeek's and dots1's first blocks,
    # first_k_dense_replace)
    routed = bool(a.num_experts) and not shared and len(outs) > 1
    k = a.experts_per_token if routed else 1
    if shared:
        I = by_slot["mlp_in"][0].out_features
    down_trains = any(weight_trains(ctx, m.name) for m in outs)
    down_awq = any(awq_saves(ctx, m.name) for m in outs)  # its fp16 copy of the product (saves.awq_saves)
    down_saves = down_trains or down_awq
    down_lora = 0.0
    for m in outs:
        if m.name in lora_names:
            branch, shares = lora_saves(ctx, m.in_features, c, m)
            down_lora += branch + (m.in_features * c if shares and not down_saves else 0)
    if routed:
        down_lora *= k / len(outs)  # each expert's LoRA sees about k/E of the tokens
    if a.mlp_gated:
        # up and act(gate) saved by their product, plus what the activation saves (its input, gate, for silu/gelu;
        # gelu_new's Python tanh formula also keeps tanh, 0.5x and 1 + tanh)
        # act(gate) in the dtype the activation returns (gelu_new under autocast: fp32, saves.act_out_bytes)
        core = I * (act_saved_bytes(ctx, down_trains) + act_out_bytes(ctx, down_trains) + c)
        if liger_patched(ctx) and not routed:  # LigerSiLUMulFunction / GEGLU: gate and up, act recomputed
            core = I * 2 * c
        out = I * c if down_trains else (I * AWQ_INPUT_BYTES if down_awq else 0)
    else:  # fc2's input is a tensor of its own unless the activation saves its output (ReLU)
        shared = a.hidden_act in SAVES_OUTPUT and a.act_dropout == 0
        core, out = I * act_saved_bytes(ctx, down_trains), (I * c if down_trains and not shared else 0)
        out += I * AWQ_INPUT_BYTES if down_awq and not (shared and c == AWQ_INPUT_BYTES) else 0
    if a.act_dropout > 0:
        # the activation's dropout keeps a bool mask (aten native_dropout); its output is fc2's input, counted above
        # when fc2 trains. T5's dropout before wo is the same. Measured: benchmarks/diagnose/cases-3.yaml (bart-large)
        core += I
    moe = 2 * a.hidden_size * c if routed else 0
    return k * (core + moe), k * out + down_lora
