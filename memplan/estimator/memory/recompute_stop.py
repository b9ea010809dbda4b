"""Where a checkpointed block's recompute stops, and what it holds there beyond the block's saves.

torch.utils.checkpoint's non-reentrant recompute (use_reentrant=False, what Trainer and TRL pass) stops at the block's
last saved tensor (early stop): in a dense block, its MLP output projection's, or that projection's LoRA branch's
lora_B. The stack frames it unwinds still hold the MLP's input, the MLP product, the projection's base output and,
under autocast, peft's cast of the product to the adapters' fp32 (`_cast_input_dtype`; lora_A saves autocast's
second cast). The backward that triggered the recompute holds the block output's gradient and, down the projection's
output, the gradients the engine made before reaching a node with saved tensors. Traced (peft 0.21, transformers
5.24, TRL's fused head): Qwen2.5-0.5B SFT LoRA all-linear bf16-mixed b8 x 1024 held the 152 MiB fp32 cast, the
76 MiB product and 56 MiB of gradients at its backward's peak, which the MLP product's backward moment had left out.
"""
from __future__ import annotations

from memplan.estimator.memory.block_tail import mlp_out_bytes, mlp_parts, mlp_readers
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.moe import expert_params
from memplan.estimator.memory.saves import adapter_compute_bytes, branch_bytes, shared_input_saves


def _out_bytes(ctx: Ctx, m) -> int:
    """A base Linear's output dtype: autocast's compute dtype, else its input's (a bitsandbytes layer returns its
    input's dtype)."""
    return ctx.compute_bytes if ctx.mixed and m.name not in ctx.quantized else ctx.act_bytes


def _held(ctx: Ctx, by_slot: dict, lora_names: set[str]) -> float:
    """Per token, what the recompute holds wherever it stops in the MLP: the gradients that triggered it (the block
    output's and those down the output projection's output to its first node with saved tensors) and the MLP's
    input, which the layer's frame keeps bound, when no Linear saves that tensor itself."""
    a, res = ctx.spec.arch, ctx.residual_bytes
    m = by_slot["mlp_out"][0]
    c_out = _out_bytes(ctx, m)
    held = a.hidden_size * res
    if m.name in lora_names:
        branch = branch_bytes(ctx)
        # the scaled branch's gradient, and the base output's where the sum is cast on the way
        held += m.out_features * (branch + (c_out if c_out != res or branch != c_out else 0))
    elif c_out != res:
        held += m.out_features * c_out  # the gradient cast to the projection's output dtype
    if not shared_input_saves(ctx, mlp_readers(by_slot), a.hidden_size, res, lora_names):
        held += a.hidden_size * res
    return held


def dense(ctx: Ctx, blk) -> bool:
    """The block has one dense MLP (input projections and one output projection), where stop_bytes is exact."""
    by_slot = blk.by_slot()
    return len(by_slot.get("mlp_out", [])) == 1 and bool(by_slot.get("mlp_in")) and not expert_params(ctx, blk)


def _at_output(ctx: Ctx, by_slot: dict, lora_names: set[str]) -> float:
    """Per token beyond _held, at the early stop: the product unless the projection saves that tensor itself, the
    projection's base output and, under autocast, peft's fp32 cast of the product."""
    m, act = by_slot["mlp_out"][0], ctx.act_bytes
    held = m.out_features * _out_bytes(ctx, m)
    if not shared_input_saves(ctx, [m], m.in_features, act, lora_names):
        held += m.in_features * act  # the product, the projection's input, saved by nobody as itself
    x_bytes = adapter_compute_bytes(ctx)
    if m.name in lora_names and ctx.mixed and act != x_bytes:
        held += m.in_features * x_bytes  # peft's cast, which autocast casts again for lora_A
    return held


def _at_input(ctx: Ctx, by_slot: dict, lora_names: set[str]) -> float:
    """Per token beyond _held (negative: less than the saves), earlier, at the MLP's last input projection with a
    LoRA branch; 0 without one.

    Its base output, lora_B's output and that times the scaling (peft's `lora_B(lora_A(x)) * scaling`), each
    [tokens, out]: in fp32 where fp32 adapters run without autocast, two fp32 tensors of the MLP's width. Not yet
    made: the output projection's saves and what the MLP saves of this projection's output (up's output, which the
    product saves; for a lone projection, a fused gate_up or a plain MLP's fc1, all the MLP's own saves).
    """
    ins = [m for m in by_slot["mlp_in"] if m.name in lora_names]
    if not ins:
        return 0.0
    m = ins[-1]
    core, out = mlp_parts(ctx, by_slot, lora_names)
    later = m.out_features * ctx.act_bytes if ctx.spec.arch.mlp_gated and len(by_slot["mlp_in"]) > 1 else core
    return m.out_features * (_out_bytes(ctx, m) + 2 * branch_bytes(ctx)) - later - out


def stop_bytes(ctx: Ctx, blk, tokens: int, lora_names: set[str]) -> int:
    """Bytes the block's recompute holds beyond the block's saves at its larger MLP moment: the early stop
    (_at_output) or, with fp32 LoRA branches, the last input projection (_at_input); both with _held.

    Blocks without a dense MLP (MoE): the coarser count made before this module, the block output's gradient, the
    MLP's input and the product where the output projection saves nothing. tokens: the block's tokens. lora_names: the Linears with a LoRA branch
    (activations._lora_names).
    """
    if not dense(ctx, blk):
        a = ctx.spec.arch
        k = a.experts_per_token if a.num_experts else 1
        read = 0 if mlp_out_bytes(ctx, blk, lora_names) else a.intermediate_size * k * ctx.act_bytes
        return int(tokens * (2 * a.hidden_size * ctx.residual_bytes + read))
    by_slot = blk.by_slot()
    held = _held(ctx, by_slot, lora_names)
    return int(tokens * (held + max(_at_output(ctx, by_slot, lora_names), _at_input(ctx, by_slot, lora_names))))
