"""Dequantization temporaries of bitsandbytes layers."""
from __future__ import annotations

from memplan.memory.context import Ctx


def dequant_temp_bytes(ctx: Ctx) -> int:
    """bitsandbytes MatMul4Bit (autograd/_functions.py) dequantizes the whole weight to the compute dtype for each
    matmul with more than one token, in forward and again in backward (it saves only the packed weight), so the
    largest quantized Linear exists once in compute dtype at a time. LLM.int8 (MatMul8bitLt) likewise materialises
    an fp16 weight for the input gradient in backward."""
    sizes = [m.in_features * m.out_features for m in ctx.spec.linears if m.name in ctx.quantized]
    if not sizes:
        return 0
    return max(sizes) * ctx.compute_bytes


def autocast_copy_bytes(ctx: Ctx, backward: bool = False, stack: str | None = None) -> int:
    """Autocast weight copies kept from forward to backward in mixed precision: every Linear weight (and the
    lm_head) is cast to the compute dtype and the matmul saves the cast for the input gradient; trainable leaves
    are also held in autocast's cache until the autocast region exits (torch/csrc/autograd ... autocast_mode.cpp
    cached_cast). With checkpointing, frozen weights' casts inside the checkpointed blocks are dropped and re-made in
    recompute; trainable ones stay cached through the forward, and Linears outside the blocks (the lm_head) are not
    checkpointed (found by the tracer). Quantized weights are not cast (bitsandbytes dequantizes instead). Blocks
    below the first trainable one record no graph: their casts are freed at once (act.graph_blocks).
    backward=True: once the forward's autocast region exits its cache is cleared, so with checkpointing the backward
    holds the casts outside the blocks plus those of the one block being recomputed (torch.utils.checkpoint re-enters
    autocast for the recompute). Measured on an H100: Qwen2.5-1.5B bf16-mixed b1 s4096 with checkpointing peaked
    1.3 GiB lower in backward than in forward, the 2.9 GiB of cached in-block casts less one block's.
    stack: only the blocks of that stack, as saved for their backward (none with checkpointing)."""
    if not (ctx.mixed and ctx.training):
        return 0
    from memplan.memory.activations import graph_blocks

    recorded = graph_blocks(ctx)
    if stack is not None:
        if ctx.setup.grad_ckpt:
            return 0
        return sum(size for m, size, _ in _cast_weights(ctx)
                   if m.stack == stack and m.block is not None and (m.stack, m.block) in recorded) * ctx.compute_bytes
    n = 0
    per_block: dict[tuple, int] = {}
    for m, size, trains in _cast_weights(ctx):
        if m.block is not None and (m.stack, m.block) not in recorded:
            continue
        if m.block is None or not ctx.setup.grad_ckpt:
            n += size
        elif backward:
            key = (m.stack, m.block)
            per_block[key] = per_block.get(key, 0) + size
        elif trains:
            n += size
    return (n + max(per_block.values(), default=0)) * ctx.compute_bytes


def largest_block_cast_bytes(ctx: Ctx, keys) -> int:
    """The autocast copies of the block among `keys` ((stack, index)) whose Linears cast the most: what its
    recompute under checkpointing makes and its matmuls save for the input gradient."""
    if not (ctx.mixed and ctx.training):
        return 0
    keys, per = set(keys), {}
    for m, size, _ in _cast_weights(ctx):
        if (m.stack, m.block) in keys:
            per[(m.stack, m.block)] = per.get((m.stack, m.block), 0) + size
    return max(per.values(), default=0) * ctx.compute_bytes


def outside_cast_bytes(ctx: Ctx) -> int:
    """The autocast copies of Linears outside the blocks (the lm_head): alive until the head's backward."""
    if not (ctx.mixed and ctx.training):
        return 0
    return sum(size for m, size, _ in _cast_weights(ctx) if m.block is None) * ctx.compute_bytes


def _cast_weights(ctx: Ctx):
    """(Linear, elements autocast casts, whether they train) for every weight a Linear's matmul casts: the base
    weight unless bitsandbytes holds it, and the LoRA adapters on it (fp32 trainable leaves, weights.lora_bytes, so
    autocast casts and caches lora_A and lora_B like any trainable weight; found by the tracer on Llama-3-8B QLoRA
    r256 all-linear with checkpointing, whose forward peak held 1.25 GiB of bf16 adapter copies)."""
    lora = {m.name for m in ctx.lora}
    r = ctx.setup.lora_r
    for m in ctx.spec.linears:
        if m.name not in ctx.quantized:
            yield m, m.in_features * m.out_features, m.name + ".weight" in ctx.trainable
        if m.name in lora:
            yield m, r * m.rank_mult * (m.in_features + m.out_features), True
