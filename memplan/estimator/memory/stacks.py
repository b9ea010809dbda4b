"""What a stack of blocks keeps outside its blocks because of the stack, not of one module. Sizes in bytes.

The dropout masks at its ends, and under gradient checkpointing the tensors every checkpointed block of the stack
receives besides its hidden states (one storage for all of them).
"""
from __future__ import annotations

from memplan import libs
from memplan.estimator.memory.position_bias import bias_per_layer, has_position_bias
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.recording import graph_blocks, input_grads

#: families whose stacks end with a dropout after the final norm (modeling_t5.py T5Stack.forward:
#: `hidden_states = self.final_layer_norm(hidden_states)` then `self.dropout(hidden_states)`; the UMT5, LongT5 and
#: SwitchTransformers stacks copy it).
FINAL_DROPOUT = {"t5", "mt5", "umt5", "longt5", "switch_transformers"}


#: releases before this one add the attention mask to T5's position bias in the first layer of a stack and pass the
#: [b, heads, q, k] sum on (modeling_t5.py T5Attention.forward `position_bias = position_bias + causal_mask`, 4.46 to
#: 5.14; 5.15 passes the bias alone and merges the mask inside the attention): under checkpointing every later
#: layer's checkpoint keeps it.
MERGED_BIAS_UNTIL = (5, 15)
#: releases before this one build the encoder's (and the cross-attentions') extended mask from any attention_mask, all
#: ones included (T5Stack.forward `(1.0 - mask) * finfo.min`, `invert_attention_mask`); transformers 5's
#: create_bidirectional_mask returns none for an unpadded batch.
ENCODER_MASK_UNTIL = (5, 0)


def _stacks(ctx: Ctx) -> tuple[tuple[str | None, int], ...]:
    """The stacks and the tokens each sees per micro-batch; an encoder-decoder's decoder sees the target length.

    Returns:
        ((stack or None, tokens per micro-batch), ...).
    """
    b = ctx.setup.batch_size
    if ctx.spec.arch.kind == "seq2seq":
        return ("encoder", b * ctx.src_len), ("decoder", b * ctx.tgt_len)
    return (None, b * ctx.src_len),


def dropout_mask_bytes(ctx: Ctx, embeds_record: bool) -> float:
    """The bool masks of the dropouts outside the blocks.

    native_dropout keeps one byte per element when its input requires grad: after the embeddings of every stack (the
    encoder-decoders' decoders too: T5Stack, BartDecoder) when they record (embeds_record), and after a T5 stack's final
    norm when the stack records or that norm trains."""
    a = ctx.spec.arch
    if a.hidden_dropout <= 0 and embed_dropout(a) <= 0:
        return 0.0
    recorded = {stack for stack, _ in graph_blocks(ctx)}
    total = 0.0
    for stack, tokens in _stacks(ctx):
        ends = int(embeds_record and embed_dropout(a) > 0)
        if a.model_type in FINAL_DROPOUT and (stack in recorded or any(
                p.block is None and p.role == "norm" and p.name.startswith(f"{stack}.") and p.name in ctx.trainable
                for p in ctx.spec.params)):
            ends += 1
        total += ends * a.hidden_size * tokens
    return total


def embed_dropout(a) -> float:
    """The dropout probability after the input embeddings (Arch.embed_dropout, else the hidden dropout).

    p = 0 returns its input (aten _dropout), no new tensor and no mask: Phi-2's embd_pdrop.
    """
    return a.hidden_dropout if a.embed_dropout is None else a.embed_dropout


def embedding_leaf_bytes(ctx: Ctx) -> float:
    """The embedding outputs autograd holds as leaves under checkpointing with frozen input embeddings.

    enable_input_require_grads (recording.input_grads) makes each lookup's output a leaf that requires grad
    (`output.requires_grad_(True)` in a forward hook), which autograd's AccumulateGrad node holds until the graph is
    freed after the backward. Where an op follows it before the first block (the embedding dropout, learned positions
    added, an embedding norm) that leaf is a tensor of its own beside the block's checkpoint input; each stack of an
    encoder-decoder looks the shared table up once.
    """
    a = ctx.spec.arch
    outside = [p for p in ctx.spec.params if p.block is None]
    if not input_grads(ctx) or any(p.role == "embedding" and p.name in ctx.trainable for p in outside):
        return 0.0
    follows = embed_dropout(a) > 0 or any(p.role == "pos_embedding" for p in outside) or any(
        p.role == "norm" and "embed" in p.name for p in outside)
    return sum(tokens for _, tokens in _stacks(ctx)) * a.hidden_size * ctx.residual_bytes if follows else 0.0


def checkpoint_inputs_bytes(ctx: Ctx) -> float:
    """The inputs the checkpointed blocks of a stack share, held until their backward.

    Non-reentrant checkpointing holds each block's inputs until its backward. Shared: an encoder-decoder's encoder
    output (an input of every decoder block, saved nowhere else once the cross-attentions' k/v projections no longer
    save it), and T5's relative position bias, which the first layer of each stack computes and passes to the others (a
    permuted view of its embedding output, [q, k, heads] in the weights' dtype; UMT5's layers compute their own)."""
    if not ctx.setup.grad_ckpt:
        return 0.0
    a = ctx.spec.arch
    recorded = graph_blocks(ctx)
    total = 0.0
    if a.kind == "seq2seq" and any(stack == "decoder" for stack, _ in recorded):
        total += ctx.setup.batch_size * ctx.src_len * a.hidden_size * ctx.residual_bytes
    if has_position_bias(a) and not bias_per_layer(a):
        # before MERGED_BIAS_UNTIL the first layer returns the bias plus the mask where there is one: [b, heads, q, k]
        merged = libs.older_than("transformers", MERGED_BIAS_UNTIL)
        padding = libs.older_than("transformers", ENCODER_MASK_UNTIL) or ctx.setup.padded  # encoder mask built
        b = ctx.setup.batch_size
        for stack, length, rows in (("encoder", ctx.src_len, b if merged and padding else 1),
                                    ("decoder", ctx.tgt_len, b if merged else 1)):  # eager: a causal mask always
            if any(s == stack and i > 0 for s, i in recorded):
                total += rows * length * length * a.num_heads * ctx.residual_bytes
        if merged and padding and any(s == "decoder" and i > 0 for s, i in recorded):
            # the decoder's cross-attentions pass on their zero bias plus the encoder mask
            total += b * ctx.tgt_len * ctx.src_len * a.num_heads * ctx.residual_bytes
    return total
