"""Activations autograd saves for backward, per block, by slot of each Linear (memplan.model.layout).

Counting rule (torch autograd, tools/autograd/derivatives.yaml): an op saves only the inputs/outputs its backward
needs for the grads actually required. A Linear saves its input only when its weight trains (grad_W = grad_out^T x);
a frozen Linear saves nothing beyond its weight. Elementwise/normalisation ops save their inputs regardless.
Under autocast (torch.amp, CUDA op lists) each Linear casts its fp32 input to the compute dtype separately, so
trainable q/k/v each save their own copy; pure 16-bit models share one. Per-token tallies generalise Korthikanti et
al. (arXiv:2205.05198, Table 2: 34sbh + 5as^2b bytes per layer for GPT with fp16, dropout, no sequence parallel) to
the dtypes, trainability, GQA, gated MLPs and attention kernels of Hugging Face models.
"""
from __future__ import annotations

from memplan.estimator.memory.attention import (CACHE_COPIES_SINCE, FUSED_QKV_CACHE, attention_kernel, attn_core,
                                      kernel_casts_kv, mask_block_bytes, padded_masks, sdpa_integration_before,
                                      windowed)
from memplan.estimator.memory.position_bias import bias_bucket_bytes, position_bias_bytes, self_bias_mask_bytes
from memplan.estimator.memory.block_tail import mlp_bytes, mlp_readers, norms_after_attention, post_attention_bytes
from memplan.model.spec import linear_case
from memplan.model.trainable import gets_no_grad
from memplan.estimator.memory.disentangled import disentangled_bytes
from memplan.estimator.memory.context import Ctx, per_model
from memplan.estimator.memory.qkv import fused_qkv_pin_bytes
from memplan.model.layout import BlockLayout, blocks
from memplan.estimator.memory.moe import expert_lora_copy_bytes, expert_params
from memplan.estimator.memory import new_tokens
from memplan.estimator.memory.recording import block_training, gradless_linears, input_grads
from memplan.estimator.memory.fused_head import trl_head
from memplan.estimator.memory.saves import (AWQ_INPUT_BYTES, act_saved_bytes, awq_saves, dora_dropout_weight_bytes,
                                            input_saves, liger_head, lora_saves, norm_bytes, shared_input_saves,
                                            weight_trains)
from memplan.estimator.memory.stacks import checkpoint_inputs_bytes, dropout_mask_bytes, embedding_leaf_bytes


def block_bytes(ctx: Ctx, blk: BlockLayout, tokens: int, seqs: tuple[int, int], lora_names: set[str],
                block_trains: bool) -> float:
    """Bytes one block saves for backward (no checkpointing) for `tokens` = batch x its sequence length.

    seqs = (query length, encoder length) for the score matrices; decoder blocks of encoder-decoders add a
    cross-attention over the encoder output.
    """
    a = ctx.spec.arch
    c, r, h = ctx.act_bytes, ctx.residual_bytes, a.hidden_size
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    kernel = attention_kernel(ctx, relative_bias=True)
    by_slot = blk.by_slot()
    cross = blk.stack == "decoder" and a.kind == "seq2seq"
    # parallel blocks normalise one input x: two LayerNorms (GPT-NeoX) save the same x, so count it once
    norms = (1 if a.parallel_block else blk.norms) - norms_after_attention(ctx, blk)  # the rest: post_attention_bytes
    per_tok = norms * norm_bytes(ctx, h, block_trains)
    # query/key norms save their fp32 input over every head, not at the hidden size
    per_tok += sum(norm_bytes(ctx, w, block_trains, w // a.head_dim, c) for w in blk.qk_norm_widths)
    # norms over another width, e.g. BitNet's ffn_sub_norm over the intermediate size
    per_tok += sum(norm_bytes(ctx, w, block_trains, in_bytes=c) for w in blk.other_norm_widths)
    if a.parallel_block and blk.norms == 1:  # attention and MLP read the same normed tensor: one input group
        per_tok += input_saves(ctx, by_slot.get("attn_in", []) + mlp_readers(by_slot), h, r, lora_names)
    else:
        per_tok += input_saves(ctx, by_slot.get("attn_in", []), h, r, lora_names)
    if _linear_mixer(ctx, blk):  # a linear attention's measured saves (linfacts) in place of the attention's
        per_tok += a.linear_saves[linear_case(c, block_trains, ctx.mixed)]
        scores = 0
    else:
        tok_core, per_score = attn_core(ctx, q_dim, kv_dim, 1, 1, kernel)
        per_tok += tok_core + fused_qkv_pin_bytes(ctx, by_slot.get("attn_in", []), kernel, q_dim, kv_dim,
                                                  bool(blk.qk_norm_widths), block_trains)
        if (a.model_type in FUSED_QKV_CACHE and kernel == "fused" and ctx.training and not ctx.setup.grad_ckpt
                and not kernel_casts_kv(ctx) and not sdpa_integration_before(ctx, CACHE_COPIES_SINCE)
                and not trl_head(ctx)):  # TRL's fused head runs the backbone with use_cache=False: no cache copies
            per_tok += 2 * kv_dim * c
        scores = a.num_heads * seqs[0] * seqs[0] * per_score * (tokens // max(seqs[0], 1))
    per_tok += post_attention_bytes(ctx, blk, lora_names, block_trains, kernel)
    experts = expert_params(ctx, blk)
    for m in by_slot.get("other", []):  # a Linear no slot names: its input if it trains, its LoRA branch
        if gets_no_grad(ctx.spec, m.name):  # its graph is freed when the module returns (select.gets_no_grad)
            continue
        per_tok += m.in_features * c if weight_trains(ctx, m.name) else 0
        per_tok += m.in_features * AWQ_INPUT_BYTES if awq_saves(ctx, m.name) else 0
        per_tok += lora_saves(ctx, m.in_features, c, m)[0] if m.name in lora_names else 0
        if m.short_name == "kv_b_proj" and kernel == "fused":
            # MLA's values are a view of kv_b_proj's output [heads x (qk_nope + v)] (expand_kv splits it; keys
            # are copied out): the fused kernel saves that view, which keeps the keys' part of the storage alive
            per_tok += (m.out_features - a.num_heads * a.v_head_dim) * c
    total = per_tok * tokens + scores + expert_lora_copy_bytes(ctx, experts, lora_names) + \
        self_bias_mask_bytes(ctx, tokens // max(seqs[0], 1), seqs[0], kernel, blk.stack) + \
        bias_bucket_bytes(ctx, blk.stack, blk.index, seqs[0]) + \
        disentangled_bytes(ctx, tokens, seqs[0], [m for _, m in blk.linears], lora_names)
    if cross:
        total += _cross_bytes(ctx, by_slot, tokens, seqs, lora_names)
    # a seq2seq decoder's self-attention gets no padding mask (collators pass no decoder_attention_mask): is_causal
    windowed_here = blk.index in a.sliding_layers and blk.stack != "encoder" and windowed(ctx)
    padded_here = padded_masks(ctx) and not (a.kind == "seq2seq" and blk.stack == "decoder")
    # DeepSeek-V3.2 masks every attention to its indexer's top-k keys (a [b, 1, s, s] mask per layer)
    if kernel == "fused" and (windowed_here or padded_here or a.indexer[0]):
        total += mask_block_bytes(ctx, tokens // max(seqs[0], 1), seqs[0])
    return total + dora_dropout_weight_bytes(ctx, [m for _, m in blk.linears], lora_names)


def _linear_mixer(ctx: Ctx, blk: BlockLayout) -> bool:
    """The block's token mixer is a measured linear attention (Arch.linear_layers, linfacts.linear_saves)."""
    a = ctx.spec.arch
    return bool(a.linear_saves) and blk.stack != "encoder" and blk.index in a.linear_layers


def _cross_bytes(ctx: Ctx, by_slot: dict, tokens: int, seqs: tuple[int, int], lora_names: set[str]) -> float:
    """Bytes the cross-attention of a decoder block saves for backward.

    q runs over decoder tokens and saves its own input (the state after self-attention, not the block's input);
    k/v run over encoder tokens and save the encoder output, counted here in every block (per_block_bytes keeps
    one storage for all decoder blocks). Pinned by tests/test_activations_autograd.py.
    """
    a = ctx.spec.arch
    q_dim = a.num_heads * a.head_dim
    batch = tokens // max(seqs[0], 1)
    enc_tokens = batch * seqs[1]
    kernel = attention_kernel(ctx, relative_bias=False)
    tok_core, per_score = attn_core(ctx, q_dim, q_dim, seqs[0], seqs[1], kernel)
    tok_core += input_saves(ctx, by_slot.get("cross_q", []), a.hidden_size, ctx.residual_bytes, lora_names)
    kv = input_saves(ctx, by_slot.get("cross_kv", []), a.hidden_size, ctx.residual_bytes, lora_names)
    masked = mask_block_bytes(ctx, batch, seqs[0], seqs[1]) if kernel == "fused" and padded_masks(ctx) else 0
    # its output's residual dropout: a third bool mask beside the self-attention's and the MLP's (post_attention_bytes)
    tok_core += a.hidden_size if a.hidden_dropout > 0 else 0
    return tok_core * tokens + kv * enc_tokens / 1.0 + a.num_heads * seqs[0] * seqs[1] * per_score * batch + masked


def stack_tokens(ctx: Ctx, stack: str | None) -> tuple[int, tuple[int, int]]:
    """Tokens and sequence lengths a block of `stack` processes per micro-batch.

    Returns:
        (tokens, (query length, key length)).
    """
    b = ctx.setup.batch_size
    if ctx.spec.arch.kind == "seq2seq" and stack == "decoder":
        return b * ctx.tgt_len, (ctx.tgt_len, ctx.src_len)
    return b * ctx.src_len, (ctx.src_len, ctx.src_len)


def per_block_bytes(ctx: Ctx) -> list[tuple[float, float]]:
    """Bytes every block saves for backward, with and without checkpointing.

    A checkpointed block keeps only its input (torch.utils.checkpoint non-reentrant, as transformers'
    gradient_checkpointing_enable uses). Blocks that run before anything trainable save nothing: with frozen
    embeddings no gradient flows below the first trainable block (layer freezing saves all lower blocks'
    activations), and in the first LoRA block of a pre-LN model the input norm runs before any adapter.

    Returns:
        [(full saved bytes, checkpointed bytes)] per block, in execution order.
    """
    lora_names = _lora_names(ctx)
    h = ctx.spec.arch.hidden_size
    out = []
    same: dict[tuple, float] = {}  # blocks of identical structure save identical bytes (speed: 80-layer models)
    encoder_output_saved = decoder_seen = False
    for blk, shape, trained, starts_here in _block_structure(ctx):
        if shape is None:
            out.append((0.0, 0.0))
            continue
        tokens, seqs = stack_tokens(ctx, blk.stack)
        if shape not in same:
            same[shape] = block_bytes(ctx, blk, tokens, seqs, lora_names, trained)
        full = same[shape]
        if blk.stack == "decoder" and ctx.spec.arch.kind == "seq2seq":
            if encoder_output_saved:  # the cross-attention k/v's shared input: one storage for every block
                full -= _encoder_output_bytes(ctx, blk, lora_names)
            encoder_output_saved = True
        # the pre-LN input norm runs before any adapter; so does an encoder-decoder's first decoder block's, whose
        # input (the frozen decoder embeddings) carries no gradient either
        first_decoder = blk.stack == "decoder" and ctx.spec.arch.kind == "seq2seq" and not decoder_seen \
            and not _embeds_record(ctx)
        decoder_seen = decoder_seen or blk.stack == "decoder"
        if (starts_here or first_decoder) and not trained and not ctx.spec.arch.post_norm:
            full -= norm_bytes(ctx, h, False) * tokens
        if starts_here and not trained:
            full -= _gradless_mlp_bytes(ctx, blk, lora_names) * tokens
        out.append((full, tokens * h * ctx.residual_bytes))
    return out


def _encoder_output_bytes(ctx: Ctx, blk: BlockLayout, lora_names: set[str]) -> float:
    """The encoder output as the cross-attention's k/v save it uncast (_cross_bytes counts it in every block)."""
    members = [m for sl, m in blk.linears if sl == "cross_kv"]
    b = ctx.setup.batch_size
    return shared_input_saves(ctx, members, ctx.spec.arch.hidden_size, ctx.residual_bytes, lora_names) * b * ctx.src_len


def _gradless_mlp_bytes(ctx: Ctx, blk: BlockLayout, lora_names: set[str]) -> float:
    """What block_bytes counted for an MLP whose input carries no gradient (recording.gradless_linears: the first
    LoRA block of a parallel model, no adapter in its MLP): its activation and products record nothing."""
    gradless = gradless_linears(ctx)
    by_slot = blk.by_slot()
    if not by_slot.get("mlp_in") or any(m.name not in gradless for m in by_slot["mlp_in"]):
        return 0.0
    return mlp_bytes(ctx, by_slot, lora_names)


@per_model()
def _embeddings_train(ctx: Ctx) -> bool:
    return any(p.role in ("embedding", "pos_embedding") and p.block is None and p.name in ctx.trainable
               for p in ctx.spec.params)


@per_model()
def _lora_names(ctx: Ctx) -> frozenset[str]:
    return frozenset(m.name for m in ctx.lora)


@per_model("grad_ckpt")
def _block_structure(ctx: Ctx) -> tuple[tuple, ...]:
    """Each block with the structure key that decides its saved bytes; blocks of equal structure save equal bytes.

    Returns:
        Per block in execution order: (block, structure key or None where nothing records, whether its base
        params train, whether recording starts in it).
    """
    lora_names = _lora_names(ctx)
    lora_blocks, trained_blocks, live = block_training(ctx)
    out = []
    for blk in blocks(ctx.spec):
        key = (blk.stack, blk.index)
        starts_here = not live and (key in trained_blocks or key in lora_blocks)
        live = live or starts_here
        shape = None if not live else (
            blk.stack, blk.norms, blk.qk_norm_widths, blk.other_norm_widths, key in trained_blocks,
            blk.index in ctx.spec.arch.sliding_layers,  # sliding and full layers hold different sdpa masks
            bias_bucket_bytes(ctx, blk.stack, blk.index, 1),  # T5's first layer holds the relative bias
            tuple((sl, m.in_features, m.out_features, m.bias, m.kind, m.rank_mult, m.name in lora_names,
                   weight_trains(ctx, m.name), awq_saves(ctx, m.name)) for sl, m in blk.linears))
        out.append((blk, shape, key in trained_blocks, starts_here))
    return tuple(out)


def _outside_tokens(ctx: Ctx, name: str) -> int:
    """Tokens a module outside the blocks sees: decoder-side modules of encoder-decoders see the target length."""
    b = ctx.setup.batch_size
    if ctx.spec.arch.kind == "seq2seq" and ("decoder." in name or name.startswith("lm_head")):
        return b * ctx.tgt_len
    return b * ctx.src_len


def outside_blocks_bytes(ctx: Ctx) -> float:
    """Saved outside the blocks: every norm (embedding norms only when the embeddings train or checkpointing hooks
    their output - else no gradient flows below frozen ones), non-output Linears such as BERT's MLM transform
    (input if it trains, plus its activation), the lm_head input when lm_head trains (its own compute-dtype copy
    under autocast), embedding dropout masks."""
    return outside_split(ctx)[0]


def outside_split(ctx: Ctx) -> tuple[float, float]:
    """outside_blocks_bytes, and the part of it the modules after the last block save.

    Backward frees that part (the final norm, a head's transform, the lm_head's input) before it reaches the
    last block, so it is not alive during the last block's recompute.

    Returns:
        (outside_blocks_bytes, bytes saved after the last block).
    """
    before, after = _outside_saves(ctx)
    return before + after + position_bias_bytes(ctx) + dropout_mask_bytes(ctx, _embeds_record(ctx)) + \
        checkpoint_inputs_bytes(ctx) + embedding_leaf_bytes(ctx), after


def _embeds_record(ctx: Ctx) -> bool:
    """The embeddings' output requires grad: their norm and dropout record."""
    return _embeddings_train(ctx) or input_grads(ctx)


def _outside_saves(ctx: Ctx) -> tuple[float, float]:
    """Bytes the norms and Linears outside the blocks save, split by where they run.

    A seq2seq encoder's final norm runs before the decoder's blocks.

    Returns:
        (bytes saved before the blocks, bytes saved after the last block).
    """
    a = ctx.spec.arch
    if not ctx.trainable and not ctx.lora:
        return 0.0, 0.0
    h, c = a.hidden_size, ctx.act_bytes
    embeds_record = _embeds_record(ctx)
    before = after = 0.0
    for p in ctx.spec.params:
        if p.block is not None or p.role != "norm" or p.name.endswith(".bias"):
            continue
        if "embed" in p.name and not embeds_record:
            continue
        n = norm_bytes(ctx, p.shape[0], p.name in ctx.trainable) * _outside_tokens(ctx, p.name)
        if "embed" in p.name or (p.stack == "encoder" and a.kind == "seq2seq"):
            before += n
        else:
            after += n
    # parameter-free final norms (OLMo's), which no parameter names
    after += a.weightless_final_norms * norm_bytes(ctx, h, False) * ctx.setup.batch_size * ctx.tgt_len
    tied = dict(ctx.spec.tied)
    lora_names = {m.name for m in ctx.lora}
    for m in ctx.spec.linears:
        if m.block is not None:
            continue
        weight = m.name + ".weight"
        trains = weight in ctx.trainable or tied.get(weight) in ctx.trainable
        tokens = _outside_tokens(ctx, m.name)
        # a Linear from another width into the hidden size projects the embeddings into the blocks (ALBERT's
        # embedding_hidden_mapping_in, ELECTRA's embeddings_project): no activation follows it, unlike a head's
        # transform
        into_blocks = not m.is_output and m.in_features != h and m.out_features == h
        n = 0.0
        if m.name in lora_names:
            branch, shares = lora_saves(ctx, m.in_features, ctx.residual_bytes, m)
            n += (branch + (m.in_features * ctx.residual_bytes if shares and not trains else 0)) * tokens
        if m.is_output:  # Liger's fused loss computes the head's weight gradient in forward: saves no input
            saves_input = trains and a.has_lm_head and not liger_head(ctx) and not trl_head(ctx)
            n += (m.in_features * c if saves_input else 0) * tokens + new_tokens.head_saved_bytes(ctx, tokens)
        else:
            act = 0 if into_blocks else m.out_features * act_saved_bytes(ctx, trains)
            n += ((m.in_features * c if trains else 0) + act) * tokens
        if into_blocks:
            before += n
        else:
            after += n
    return before, after
