"""Activations autograd saves for backward, per block, by slot of each Linear (memplan.memory.layout).

Counting rule (torch autograd, tools/autograd/derivatives.yaml): an op saves only the inputs/outputs its backward
needs for the grads actually required. A Linear saves its input only when its weight trains (grad_W = grad_out^T x);
a frozen Linear saves nothing beyond its weight. Elementwise/normalisation ops save their inputs regardless.
Under autocast (torch.amp, CUDA op lists) each Linear casts its fp32 input to the compute dtype separately, so
trainable q/k/v each save their own copy; pure 16-bit models share one. Per-token tallies generalise Korthikanti et
al. (arXiv:2205.05198, Table 2: 34sbh + 5as^2b bytes per layer for GPT with fp16, dropout, no sequence parallel) to
the dtypes, trainability, GQA, gated MLPs and attention kernels of Hugging Face models.
"""
from __future__ import annotations

from memplan.memory.attention import FUSED_QKV_CACHE, POSITION_BIAS, attention_kernel, attn_core, kernel_casts_kv
from memplan.memory.context import Ctx
from memplan.memory.layout import BlockLayout, blocks



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


def _act_bytes(ctx: Ctx) -> float:
    pure, mixed = ACT_SAVED.get(ctx.spec.arch.hidden_act, ACT_SAVED["default"])
    return (mixed if ctx.mixed else pure)(ctx.act_bytes)


def _trains(ctx: Ctx, name: str) -> bool:
    return name + ".weight" in ctx.trainable


def _input_saves(ctx: Ctx, members, in_dim: int, in_bytes: int, lora_names: set[str]) -> float:
    """Bytes per token saved for a group of Linears reading one shared input of `in_dim` elements: the trained
    Linears' inputs (one cast copy each under autocast, else the shared tensor once) plus each LoRA branch."""
    c = ctx.act_bytes
    cast = in_bytes != c
    trained = sum(1 for m in members if _trains(ctx, m.name))
    shared_saved = trained > 0 and not cast
    saved = (trained * in_dim * c if cast else in_dim * c) if trained else 0.0
    for m in members:
        if m.name in lora_names:
            branch, shares_input = _lora_saves(ctx, in_dim, in_bytes)
            saved += branch
            if shares_input and not shared_saved:
                saved += in_dim * in_bytes  # the shared input itself, saved once by the first lora_A
                shared_saved = True
    return saved


def _lora_saves(ctx: Ctx, in_dim: int, in_bytes: int) -> tuple[float, bool]:
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
#: RMSNorms that apply the weight in fp32 (`output * (1.0 + self.weight.float())`, GemmaRMSNorm) and cast after:
#: the normalised tensor a trainable weight needs is fp32 whatever the model dtype.
RMS_FP32_WEIGHT = {"gemma", "gemma2"}


def _norm_bytes(ctx: Ctx, h: int, trains: bool, model_type: str = "") -> float:
    """RMSNorm (HF Llama style: upcast to fp32, x*rsqrt(var), weight * x.to(dtype)): saves the fp32 input and,
    when the weight trains, the normalised tensor. LayerNorm (ATen native_layer_norm): saves its input (+ [t] stats)."""
    r = ctx.residual_bytes
    if ctx.spec.arch.norm == "rmsnorm":
        mt = model_type or ctx.spec.arch.model_type
        keeps = mt in RMS_KEEPS_INPUT and r != 4
        normed = 4 if mt in RMS_FP32_WEIGHT else r
        return 4 * h + (normed * h if trains else 0) + (r * h if keeps else 0)
    return r * h + 8


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
    eager = kernel != "fused"  # the attention's output is not saved by the kernel: o-proj saves its own input
    by_slot: dict[str, list] = {}
    for sl, m in blk.linears:
        by_slot.setdefault(sl, []).append(m)
    cross = blk.stack == "decoder" and a.kind == "seq2seq"
    # parallel blocks normalise one input x: two LayerNorms (GPT-NeoX) save the same x, so count it once
    per_tok = (1 if a.parallel_block else blk.norms) * _norm_bytes(ctx, h, block_trains)
    if a.parallel_block and blk.norms == 1:  # attention and MLP read the same normed tensor: one input group
        per_tok += _input_saves(ctx, by_slot.get("attn_in", []) + by_slot.get("mlp_in", []), h, r, lora_names)
    else:
        per_tok += _input_saves(ctx, by_slot.get("attn_in", []), h, r, lora_names)
        per_tok += _input_saves(ctx, by_slot.get("mlp_in", []), h, r, lora_names)
    tok_core, per_score = attn_core(ctx, q_dim, kv_dim, 1, 1, kernel)
    per_tok += tok_core
    if (a.model_type in FUSED_QKV_CACHE and kernel == "fused" and ctx.training and not ctx.setup.grad_ckpt
            and not kernel_casts_kv(ctx)):
        per_tok += 2 * kv_dim * c
    scores = a.num_heads * seqs[0] * seqs[0] * per_score * (tokens // max(seqs[0], 1))
    for m in by_slot.get("attn_out", []):
        saved_input = eager and _trains(ctx, m.name)
        per_tok += q_dim * c if saved_input else 0
        if m.name in lora_names:
            branch, shares = _lora_saves(ctx, m.in_features, c)
            # sdpa's output is already saved by the attention; eager's contiguous copy is not unless o trains
            per_tok += branch + (m.in_features * c if shares and eager and not saved_input else 0)
    experts = expert_params(ctx, blk)
    per_tok += _moe_bytes(ctx, experts, lora_names) if experts else _mlp_bytes(ctx, by_slot, lora_names)
    for m in by_slot.get("other", []):
        per_tok += m.in_features * c if _trains(ctx, m.name) else 0
    if a.hidden_dropout > 0:
        per_tok += 2 * h  # one bool mask per residual dropout (attention and MLP outputs)
    total = per_tok * tokens + scores + expert_lora_copy_bytes(ctx, experts, lora_names) + \
        self_bias_mask_bytes(ctx, tokens // max(seqs[0], 1), seqs[0], kernel)
    if cross:
        total += _cross_bytes(ctx, by_slot, tokens, seqs, lora_names)
    return total


def _mlp_bytes(ctx: Ctx, by_slot: dict, lora_names: set[str]) -> float:
    """MLP: gated (SwiGLU/GeGLU) saves gate, act(gate), up and, if down trains, their product; plain MLPs save the
    activation's inputs (ACT_SAVED) and, if fc2 trains, its input. MoE multiplies by top-k (each token visits k
    experts) and adds the gathered expert inputs/outputs."""
    a = ctx.spec.arch
    c, I = ctx.act_bytes, a.intermediate_size
    k = a.experts_per_token if a.num_experts else 1
    outs = by_slot.get("mlp_out", [])
    down_trains = any(_trains(ctx, m.name) for m in outs)
    down_lora = 0.0
    for m in outs:
        if m.name in lora_names:
            branch, shares = _lora_saves(ctx, m.in_features, c)
            down_lora += branch + (m.in_features * c if shares and not down_trains else 0)
    if a.num_experts and outs:
        down_lora *= k / len(outs)  # each expert's LoRA sees about k/E of the tokens
    if a.mlp_gated:
        # up and act(gate) saved by their product, plus what the activation saves (its input, gate, for silu/gelu;
        # gelu_new's Python tanh formula also keeps tanh, 0.5x and 1 + tanh: found by the tracer on flan-t5-xl
        # LoRA, -6.5% before)
        core = I * (_act_bytes(ctx) + 2 * c) + (I * c if down_trains else 0)
    else:
        shared = a.hidden_act in SAVES_OUTPUT and a.act_dropout == 0
        core = I * _act_bytes(ctx) + (I * c if down_trains and not shared else 0)
    if a.act_dropout > 0:
        # the activation's dropout keeps a bool mask (aten native_dropout); its output is fc2's input, counted above
        # when fc2 trains. Measured: bart-large LoRA bf16 b16 s256 kept 24 x [4096, 4096] bool masks at
        # modeling_bart.py's activation dropout (benchmarks/diagnose/cases-3.yaml); T5's dropout before wo is the
        # same (found by the tracer: t5-base full bf16-mixed b16 s128, 6 MiB per block).
        core += I
    moe = 2 * a.hidden_size * c if a.num_experts else 0
    return k * (core + moe) + down_lora


def expert_params(ctx: Ctx, blk: BlockLayout) -> list:
    """The fused expert tensors of a block (transformers 5 MoE: [E, out, in] parameters, not Linears)."""
    if not ctx.spec.arch.num_experts:
        return []
    return [p for p in ctx.spec.params if p.role == "expert" and p.block == blk.index and p.stack == blk.stack]


def _moe_bytes(ctx: Ctx, experts: list, lora_names: set[str]) -> float:
    """Fused experts (transformers integrations/moe.py grouped_mm_experts_forward): each token visits k experts;
    the matmuls run in the experts' weight dtype - _grouped_mm casts its input to weight.dtype and aten::_grouped_mm
    has no autocast kernel, so bf16-mixed and QLoRA (peft casts the unquantized experts to fp32) compute them in
    fp32. Saved per visit: the gate_up output [2I] and act(gate) [I]; the product [I] when down_proj needs a weight
    gradient; the down output [H] (the routing-weight multiply); the gathered input [H] when gate_up needs one.
    Found by the tracer on Mixtral-8x7B (bf16-mixed LoRA -3.0% before)."""
    a = ctx.spec.arch
    e, i, h = ctx.weight_bytes, a.intermediate_size, a.hidden_size

    def grads(suffix: str) -> bool:
        return any(p.name.endswith(suffix) and (p.name in ctx.trainable or p.name in lora_names) for p in experts)
    up, down = grads("gate_up_proj") or grads("up_proj"), grads("down_proj")
    return a.experts_per_token * (3 * i * e + (i * e if down else 0) + h * e + (h * e if up else 0))


def expert_lora_copy_bytes(ctx: Ctx, experts: list, lora_names: set[str]) -> int:
    """peft's LoRA on fused expert tensors (tuners/lora/layer.py ParamWrapper) forms W + BA with baddbmm: a full copy
    of each targeted expert tensor in its dtype every forward, which grouped_mm saves for the input gradient
    (Mixtral all-linear: 2.6 GiB per block in bf16; the tracer's -48% before)."""
    return sum(p.numel for p in experts if p.name in lora_names) * ctx.weight_bytes


def largest_expert_lora_copy_bytes(ctx: Ctx) -> int:
    """The largest single W + BA copy (expert_lora_copy_bytes) of any expert tensor: its gradient is a working
    tensor of that block's backward."""
    if not ctx.spec.arch.num_experts or not ctx.lora:
        return 0
    lora = {m.name for m in ctx.lora}
    return max((expert_lora_copy_bytes(ctx, [p], lora) for p in ctx.spec.params if p.role == "expert"), default=0)


def _cross_bytes(ctx: Ctx, by_slot: dict, tokens: int, seqs: tuple[int, int], lora_names: set[str]) -> float:
    """Cross-attention of a decoder block: q over decoder tokens, k/v over encoder tokens (inputs: the encoder
    output, shared by every decoder block)."""
    a = ctx.spec.arch
    q_dim = a.num_heads * a.head_dim
    batch = tokens // max(seqs[0], 1)
    enc_tokens = batch * seqs[1]
    tok_core, per_score = attn_core(ctx, q_dim, q_dim, seqs[0], seqs[1], attention_kernel(ctx, relative_bias=False))
    kv = _input_saves(ctx, by_slot.get("cross_kv", []), a.hidden_size, ctx.residual_bytes, lora_names)
    return tok_core * tokens + kv * enc_tokens / 1.0 + a.num_heads * seqs[0] * seqs[1] * per_score * batch


def stack_tokens(ctx: Ctx, stack: str | None) -> tuple[int, tuple[int, int]]:
    """(tokens, (query len, key len)) a block of `stack` processes per micro-batch."""
    b = ctx.setup.batch_size
    if ctx.spec.arch.kind == "seq2seq" and stack == "decoder":
        return b * ctx.tgt_len, (ctx.tgt_len, ctx.src_len)
    return b * ctx.src_len, (ctx.src_len, ctx.src_len)


def input_grads(ctx: Ctx) -> bool:
    """Checkpointing makes the embedding output require grad: transformers' gradient_checkpointing_enable calls
    enable_input_require_grads() for input_ids models (modeling_utils.py _activation_checkpointing_enable; peft's
    k-bit preparation does the same), so every block records a graph, frozen ones included. Found by the tracer:
    Mistral-7B freeze bf16-mixed checkpointed -2.0%, SmolLM2 freeze bf16 -3.7%, Phi-3 freeze eager -6.9% before."""
    return ctx.training and ctx.setup.grad_ckpt and bool(ctx.trainable or ctx.lora)


def _block_training(ctx: Ctx) -> tuple[set, set, bool]:
    """(blocks with LoRA adapters, blocks with trainable base params, whether every block records from the start:
    the embeddings train, or checkpointing hooks their output - input_grads)."""
    lora_blocks = {(m.stack, m.block) for m in ctx.lora}
    trained_blocks = {(p.stack, p.block) for p in ctx.spec.params if p.name in ctx.trainable and p.block is not None}
    live = input_grads(ctx) or any(p.block is None and p.role in ("embedding", "pos_embedding")
                                   and p.name in ctx.trainable for p in ctx.spec.params)
    return lora_blocks, trained_blocks, live


def frozen_tail(ctx: Ctx, sizes: list[tuple[float, float]]) -> tuple[list[tuple], float, float]:
    """Blocks the backward still passes once every weight gradient exists: with input_grads, the recorded blocks
    below the first block with anything trainable (execution order), recomputed and back-propagated for the input
    gradient alone. sizes: per_block_bytes(ctx). -> (their keys, their checkpoint inputs, the largest one's
    recompute)."""
    if not input_grads(ctx):
        return [], 0.0, 0.0
    lora_blocks, trained, _ = _block_training(ctx)
    keys, inputs, full = [], 0.0, 0.0
    for (f, ck), blk in zip(sizes, blocks(ctx.spec)):
        key = (blk.stack, blk.index)
        if key in trained or key in lora_blocks:
            break
        keys.append(key)
        inputs += ck
        full = max(full, f)
    return keys, inputs, full


def graph_blocks(ctx: Ctx) -> set[tuple]:
    """(stack, index) of the blocks autograd records: from the first block with anything trainable on (in execution
    order), or all of them when the embeddings train. Below it no tensor requires grad, so nothing is saved."""
    lora_blocks, trained_blocks, live = _block_training(ctx)
    out = set()
    for blk in blocks(ctx.spec):
        key = (blk.stack, blk.index)
        live = live or key in trained_blocks or key in lora_blocks
        if live:
            out.add(key)
    return out


def per_block_bytes(ctx: Ctx) -> list[tuple[float, float]]:
    """[(full saved bytes, checkpointed bytes)] for every block, in execution order. A checkpointed block keeps
    only its input (torch.utils.checkpoint non-reentrant, as transformers' gradient_checkpointing_enable uses).

    Blocks that run before anything trainable save nothing: with frozen embeddings no gradient flows below the
    first trainable block (layer freezing saves all lower blocks' activations), and in the first LoRA block of a
    pre-LN model the input norm runs before any adapter.
    """
    lora_names = {m.name for m in ctx.lora}
    lora_blocks, trained_blocks, live = _block_training(ctx)
    h = ctx.spec.arch.hidden_size
    out = []
    same: dict[tuple, float] = {}  # blocks of identical structure save identical bytes (speed: 80-layer models)
    for blk in blocks(ctx.spec):
        key = (blk.stack, blk.index)
        tokens, seqs = stack_tokens(ctx, blk.stack)
        starts_here = not live and (key in trained_blocks or key in lora_blocks)
        live = live or starts_here
        if not live:
            out.append((0.0, 0.0))
            continue
        shape = (blk.stack, blk.norms, key in trained_blocks,
                 tuple((sl, m.in_features, m.out_features, m.bias, m.kind, m.rank_mult, m.name in lora_names,
                        _trains(ctx, m.name))
                       for sl, m in blk.linears))
        if shape not in same:
            same[shape] = block_bytes(ctx, blk, tokens, seqs, lora_names, key in trained_blocks)
        full = same[shape]
        if starts_here and key not in trained_blocks and not ctx.spec.arch.post_norm:
            full -= _norm_bytes(ctx, h, False) * tokens  # the pre-LN input norm runs before any adapter
        out.append((full, tokens * h * ctx.residual_bytes))
    return out


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
    a = ctx.spec.arch
    if not ctx.trainable and not ctx.lora:
        return 0.0
    h, c = a.hidden_size, ctx.act_bytes
    embeds_train = any(p.role in ("embedding", "pos_embedding") and p.block is None and p.name in ctx.trainable
                       for p in ctx.spec.params)
    embeds_record = embeds_train or input_grads(ctx)  # their output requires grad: the norm and dropout record
    total = 0.0
    for p in ctx.spec.params:
        if p.block is not None or p.role != "norm" or p.name.endswith(".bias"):
            continue
        if "embed" in p.name and not embeds_record:
            continue
        total += _norm_bytes(ctx, p.shape[0], p.name in ctx.trainable, a.model_type) * _outside_tokens(ctx, p.name)
    tied = dict(ctx.spec.tied)
    lora_names = {m.name for m in ctx.lora}
    for m in ctx.spec.linears:
        if m.block is not None:
            continue
        weight = m.name + ".weight"
        trains = weight in ctx.trainable or tied.get(weight) in ctx.trainable
        tokens = _outside_tokens(ctx, m.name)
        if m.name in lora_names:
            branch, shares = _lora_saves(ctx, m.in_features, ctx.residual_bytes)
            total += (branch + (m.in_features * ctx.residual_bytes if shares and not trains else 0)) * tokens
        if m.is_output:
            total += (m.in_features * c if trains and a.has_lm_head else 0) * tokens
        else:
            total += ((m.in_features * c if trains else 0) + m.out_features * _act_bytes(ctx)) * tokens
    if a.hidden_dropout > 0 and embeds_record:
        total += h * ctx.setup.batch_size * ctx.src_len
    return total + position_bias_bytes(ctx)


def _bias_mask_dtype_bytes(ctx: Ctx) -> int:
    """The float mask sdpa keeps: autocast's compute-dtype cast of it under mixed precision (sdpa is on autocast's
    lower-precision list), else the bias's own dtype (the residual dtype of the embedding it comes from)."""
    return ctx.compute_bytes if ctx.mixed else ctx.residual_bytes


def self_bias_mask_bytes(ctx: Ctx, batch: int, q_len: int, kernel: str) -> float:
    """T5/mT5 self-attention under a fused sdpa kernel (transformers >= 5.20): every layer's call builds its own
    [b, heads, q, q] mask from the shared position bias (integrations/sdpa_attention.py create_position_bias_mask:
    merged with the padding or causal mask, then `.contiguous()`; autocast casts it again), which the kernel keeps
    for backward - one per layer, not one per stack. The batch dimension comes from the padding mask (unpadded
    batches may keep [1, ...]: the padded-batch upper bound). Found by the tracer: t5-base LoRA bf16 r64 b16 s256
    sdpa -9.5% before. Math kernel (older transformers): added to the scores, nothing kept."""
    a = ctx.spec.arch
    if a.model_type not in POSITION_BIAS or ctx.attn_impl != "sdpa" or kernel != "fused":
        return 0.0
    return batch * a.num_heads * q_len * q_len * _bias_mask_dtype_bytes(ctx)


def position_bias_bytes(ctx: Ctx) -> float:
    """T5/mT5 decoders: the cross-attention's zero bias, one [b, heads, q_len, k_len] tensor shared by every layer
    (the self-attentions' per-layer masks are in the blocks: self_bias_mask_bytes). Only a recorded decoder keeps
    it (graph_blocks: found by the tracer on t5-base freeze)."""
    a = ctx.spec.arch
    if a.model_type not in POSITION_BIAS or ctx.attn_impl == "eager":
        return 0.0  # eager adds the bias to the scores, which saves nothing
    recorded = {stack for stack, _ in graph_blocks(ctx)}
    if a.kind != "seq2seq" or "decoder" not in recorded:
        return 0.0
    return ctx.setup.batch_size * a.num_heads * ctx.tgt_len * ctx.src_len * _bias_mask_dtype_bytes(ctx)
