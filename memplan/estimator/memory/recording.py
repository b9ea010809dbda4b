"""Which blocks autograd records a graph for.

From the first block with anything trainable on, or all of them when the embeddings train or checkpointing hooks
their output. What they save is memplan.estimator.memory.activations'.
"""
from __future__ import annotations

from memplan.estimator.memory.context import Ctx, per_model
from memplan.model.layout import blocks


def input_grads(ctx: Ctx) -> bool:
    """Checkpointing makes the embedding output require grad, so every block records a graph, frozen ones included.

    transformers' gradient_checkpointing_enable calls enable_input_require_grads() for input_ids models
    (modeling_utils.py _activation_checkpointing_enable); peft's k-bit preparation does the same.
    """
    return ctx.training and ctx.setup.grad_ckpt and bool(ctx.trainable or ctx.lora)


@per_model("grad_ckpt")
def block_training(ctx: Ctx) -> tuple[frozenset, frozenset, bool]:
    """Which blocks train and whether recording starts before the first block.

    Returns:
        (blocks with LoRA adapters, blocks with trainable base params, whether every block records from the start:
        the embeddings train, or checkpointing hooks their output - input_grads).
    """
    lora_blocks = frozenset((m.stack, m.block) for m in ctx.lora)
    trained_blocks = frozenset((p.stack, p.block) for p in ctx.spec.params
                               if p.name in ctx.trainable and p.block is not None)
    live = input_grads(ctx) or any(p.block is None and p.role in ("embedding", "pos_embedding")
                                   and p.name in ctx.trainable for p in ctx.spec.params)
    return lora_blocks, trained_blocks, live


def frozen_tail(ctx: Ctx, sizes: list[tuple[float, float]]) -> tuple[list[tuple], float, float]:
    """Blocks the backward still passes once every weight gradient exists.

    With input_grads, the recorded blocks below the first block with anything trainable (execution order),
    recomputed and back-propagated for the input gradient alone. sizes: activations.per_block_bytes(ctx).

    Returns:
        (their keys, their checkpoint inputs' bytes, the largest one's recompute bytes).
    """
    if not input_grads(ctx):
        return [], 0.0, 0.0
    lora_blocks, trained, _ = block_training(ctx)
    keys, inputs, full = [], 0.0, 0.0
    for (f, ck), blk in zip(sizes, blocks(ctx.spec)):
        key = (blk.stack, blk.index)
        if key in trained or key in lora_blocks:
            break
        keys.append(key)
        inputs += ck
        full = max(full, f)
    return keys, inputs, full


@per_model("grad_ckpt")
def graph_blocks(ctx: Ctx) -> frozenset[tuple]:
    """(stack, index) of the blocks autograd records.

    From the first block with anything trainable on (in execution order), or all of them when the embeddings train.
    Below it no tensor requires grad, so nothing is saved.
    """
    lora_blocks, trained_blocks, live = block_training(ctx)
    out = set()
    for blk in blocks(ctx.spec):
        key = (blk.stack, blk.index)
        live = live or key in trained_blocks or key in lora_blocks
        if live:
            out.add(key)
    return frozenset(out)


@per_model("grad_ckpt")
def gradless_linears(ctx: Ctx) -> frozenset[str]:
    """Linears of the block where recording starts whose input carries no gradient.

    Recording starts there when nothing below trains, there are no input_grads and the block's own base parameters are
    frozen (LoRA). Their matmuls save neither the input nor, under autocast, the weight's cast: the attention's input
    projections (they read the block's gradless input or its frozen norm's output), and in a parallel block (GPT-J,
    GPT-NeoX, Falcon, Phi) the MLP when none of its Linears is adapted - it reads the same normed input, so its
    activation saves nothing either.
    """
    lora_blocks, trained, live = block_training(ctx)
    if live:
        return frozenset()
    lora = {m.name for m in ctx.lora}
    for blk in blocks(ctx.spec):
        key = (blk.stack, blk.index)
        if key in trained:
            return frozenset()
        if key in lora_blocks:
            names = {m.name for sl, m in blk.linears if sl == "attn_in"}
            mlp = [m.name for sl, m in blk.linears if sl in ("mlp_in", "mlp_out", "mlp_gate")]
            if ctx.spec.arch.parallel_block and mlp and not lora.intersection(mlp):
                names.update(mlp)
            return frozenset(names)
    return frozenset()
