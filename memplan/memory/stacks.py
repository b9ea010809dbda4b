"""What a stack of blocks keeps outside its blocks because of the stack, not of one module: the dropout masks at its
ends, and under gradient checkpointing the tensors every checkpointed block of the stack receives besides its hidden
states (one storage for all of them). Sizes in bytes."""
from __future__ import annotations

from memplan.memory.attention import bias_per_layer, has_position_bias
from memplan.memory.context import Ctx
from memplan.memory.recording import graph_blocks

#: families whose stacks end with a dropout after the final norm (modeling_t5.py T5Stack.forward:
#: `hidden_states = self.final_layer_norm(hidden_states)` then `self.dropout(hidden_states)`; the UMT5, LongT5 and
#: SwitchTransformers stacks copy it). Found by the tracer: t5-base full bf16 b8 s512 with checkpointing, -1.5%
#: with this, the decoder's embedding dropout, the encoder output and the relative bias below uncounted.
FINAL_DROPOUT = {"t5", "mt5", "umt5", "longt5", "switch_transformers"}


def _stacks(ctx: Ctx) -> tuple[tuple[str | None, int], ...]:
    """(stack, tokens per micro-batch) for each stack: an encoder-decoder's decoder sees the target length."""
    b = ctx.setup.batch_size
    if ctx.spec.arch.kind == "seq2seq":
        return ("encoder", b * ctx.src_len), ("decoder", b * ctx.tgt_len)
    return (None, b * ctx.src_len),


def dropout_mask_bytes(ctx: Ctx, embeds_record: bool) -> float:
    """The bool masks of the dropouts outside the blocks (native_dropout keeps one byte per element when its input
    requires grad): after the embeddings of every stack (the encoder-decoders' decoders too: T5Stack, BartDecoder)
    when they record (embeds_record), and after a T5 stack's final norm when the stack records or that norm
    trains."""
    a = ctx.spec.arch
    if a.hidden_dropout <= 0:
        return 0.0
    recorded = {stack for stack, _ in graph_blocks(ctx)}
    total = 0.0
    for stack, tokens in _stacks(ctx):
        ends = int(embeds_record)
        if a.model_type in FINAL_DROPOUT and (stack in recorded or any(
                p.block is None and p.role == "norm" and p.name.startswith(f"{stack}.") and p.name in ctx.trainable
                for p in ctx.spec.params)):
            ends += 1
        total += ends * a.hidden_size * tokens
    return total


def checkpoint_inputs_bytes(ctx: Ctx) -> float:
    """Under gradient checkpointing (non-reentrant: each block's checkpoint holds its inputs until its backward), the
    inputs the blocks of a stack share: an encoder-decoder's encoder output (an input of every decoder block, saved
    nowhere else once the cross-attentions' k/v projections no longer save it), and T5's relative position bias,
    which the first layer of each stack computes and passes to the others (a permuted view of its embedding output,
    [q, k, heads] in the weights' dtype; UMT5's layers compute their own)."""
    if not ctx.setup.grad_ckpt:
        return 0.0
    a = ctx.spec.arch
    recorded = graph_blocks(ctx)
    total = 0.0
    if a.kind == "seq2seq" and any(stack == "decoder" for stack, _ in recorded):
        total += ctx.setup.batch_size * ctx.src_len * a.hidden_size * ctx.residual_bytes
    if has_position_bias(a) and not bias_per_layer(a):
        for stack, length in (("encoder", ctx.src_len), ("decoder", ctx.tgt_len)):
            if any(s == stack and i > 0 for s, i in recorded):
                total += length * length * a.num_heads * ctx.residual_bytes
    return total
