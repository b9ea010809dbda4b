"""The phases of a step and what is alive in each, in bytes per component.

Training, inference, and the per-rank view under data parallelism; memplan.estimator.breakdown takes the largest
phase as the peak.
"""
from __future__ import annotations

from memplan.estimator.attention_phases import (attention_backward_phase, encoder_backward_phase,
                                      first_attention_backward_phase, in_forward_phases, indexer_backward_phase,
                                      largest)
from memplan.estimator.memory import activations as act
from memplan.estimator.memory import distributed as dist
from memplan.estimator.memory import inference as inf
from memplan.estimator.memory import logits as lg
from memplan.estimator.memory import optimizer as opt
from memplan.estimator.memory import (block_ends, dora, forward_block, moe, offload, quant, recompute_stop,
                                      recording, weights)
from memplan.gpus import cublas_workspace_bytes
from memplan.model import layout
from memplan.estimator.memory.context import Ctx
from memplan.estimator.memory.masks import checkpointed_mask_bytes, mask_bytes
from memplan.estimator.memory.weights import numel
from memplan.model.spec import linear_case


def _resident(ctx: Ctx) -> dict[str, int]:
    paged = ctx.training and opt.is_paged(ctx)
    return {
        "weights": weights.weights_bytes(ctx),
        "quant_state": weights.quant_state_bytes(ctx),
        "lora_adapters": weights.lora_bytes(ctx) if ctx.training else 0,
        "optimizer_state": opt.optimizer_state_bytes(ctx) if ctx.training and not paged else 0,
        "cublas_workspace": cublas_workspace_bytes(ctx.training),
    }


def training_phases(ctx: Ctx) -> dict[str, dict[str, int]]:
    """The phases of a training step, each a dict of bytes per component.

    forward: end of forward, all saved activations + the loss computation. backward_start: all activations +
    the loss gradients, or (checkpointing) the last block's recompute. lm_head_backward: the logits gradient
    and the head's weight gradient. backward_end: all gradients. embedding_backward: a tied embedding's two gradient
    contributions summed (lg.tied_accumulation_bytes); decoder_embedding_backward: the same sum for an
    encoder-decoder's decoder embedding, with the encoder's activations still saved. In between,
    backward frees the activations of block i as it allocates the gradients of block i, so the live bytes move
    linearly from the start to the end and the two ends bound the whole backward. optimizer_step: grads + state +
    step temporaries."""
    s = ctx.setup
    res = _resident(ctx)
    grads = opt.gradient_bytes(ctx)
    held_grads = grads if s.grad_accum > 1 else 0  # zero_grad(set_to_none=True) frees them between steps
    blocks = act.per_block_bytes(ctx)
    rows = block_ends.recording(ctx, blocks)
    outside, after = act.outside_split(ctx)
    saved = sum(ck if s.grad_ckpt else full for full, ck in blocks) + outside
    if offload.offloads(ctx):  # TRL's activation offloading: the blocks' inputs on the host but two
        saved = offload.device_block_saves(ctx, [ck for _, ck in blocks]) + outside
    recompute = block_ends.largest_recompute_bytes(ctx, rows)
    casts = quant.autocast_copy_bytes(ctx)
    deq = quant.dequant_temp_bytes(ctx)
    dora_temps = dora.dora_temp_bytes(ctx)
    # what a block's forward makes on the way, again in backward: bitsandbytes' dequantized weight (its backward
    # dequantizes too), and DoRA's norm rebuild where checkpointing recomputes the block
    recompute_temps = max(deq, dora_temps if s.grad_ckpt else 0)
    common = {**res, "gradients": held_grads, "activations": int(saved), "autocast_weight_copies": casts}
    back = {**common, "autocast_weight_copies": quant.autocast_copy_bytes(ctx, backward=True),
            "attention_mask": checkpointed_mask_bytes(ctx)}
    temps = _backward_temp_bytes(ctx)
    bwd_work = recompute + temps
    tied = lg.tied_accumulation_bytes(ctx)
    # with checkpointing the recomputed block's autocast copies exist only once its recompute starts, after the
    # loss's and the head's backward (the forward's cache was cleared when autocast exited: torch/amp
    # autocast_mode.py clear_autocast_cache); those two phases hold the head's copy alone
    head_casts = {"autocast_weight_copies": quant.outside_cast_bytes(ctx)} if s.grad_ckpt else {}
    loss_side = {**back, **head_casts, "logits": lg.logits_backward_bytes(ctx)}
    in_blocks = int(saved - after)  # the head's side is done once backward reaches a block
    ends = block_ends.end_blocks(rows)
    # the head's backward is done too: its autocast copy is freed (the attention's backward likewise)
    block_casts = {"autocast_weight_copies": back["autocast_weight_copies"] - quant.outside_cast_bytes(ctx)}
    freed = block_ends.attention_backward_freed_bytes(ctx, rows, recompute)
    recompute_side = {**back, **block_casts, **_mlp_moment(ctx, ends[1] if ends else None, in_blocks,
                                                           block_ends.largest_recompute_bytes(ctx, rows, at_mlp=True), temps),
                      "dequant_temporaries": quant.recompute_dequant_bytes(ctx)}
    return {
        # a block's dequantized weight is freed before the head computes the logits: the larger of the two
        "forward": {**common, "attention_mask": mask_bytes(ctx), "forward_kv_cache": inf.training_cache_bytes(ctx),
                    **_larger(("logits", lg.logits_forward_bytes(ctx)), ("dequant_temporaries", deq))},
        **in_forward_phases(ctx, common, int(saved - after), blocks),
        "backward_start": largest(loss_side, recompute_side, _recompute_end(ctx, back, block_casts, in_blocks, rows),
                                  _quantized_backward(ctx, {**back, **block_casts}, in_blocks, recompute)),
        "lm_head_backward": {**back, **head_casts, "gradients": held_grads or lg.head_grad_bytes(ctx),
                             "logits": lg.head_backward_bytes(ctx)},
        "backward_end": _backward_end(ctx, res, grads, ends, bwd_work, temps, recompute_temps, int(outside - after)),
        **first_attention_backward_phase(ctx, res, grads - _late_grad_bytes(ctx), ends[0] if ends else None,
                                         int(outside - after), recompute_temps),
        "embedding_backward": {**res, "gradients": grads, "backward_temporaries": tied},
        **attention_backward_phase(ctx, res, held_grads, int(in_blocks + recompute - freed), {**back, **block_casts}),
        **encoder_backward_phase(ctx, res, grads, held_grads, blocks, int(outside - after), back, temps),
        **indexer_backward_phase(ctx, grads - _late_grad_bytes(ctx), ends, int(outside - after), in_blocks,
                                 {**back, **block_casts}),
        **_frozen_backward_phase(ctx, res, grads, blocks),
        **_decoder_embedding_phase(ctx, res, grads, held_grads, blocks, tied),
        "optimizer_step": {**res, "gradients": grads, "optimizer_temporaries": opt.optimizer_temp_bytes(ctx)},
    }


def _quantized_backward(ctx: Ctx, back: dict, before: int, recompute: float) -> dict[str, int]:
    """LoRA on an AWQ or FP8 base: the last block's largest quantized Linear in backward, as phase components; {}
    elsewhere.

    What the blocks saved (with checkpointing, the block's recompute), the residual stream's gradient, the kernel's
    temporaries (quant.backward_dequant_bytes) and the 16-bit input gradient its matmul returns.
    """
    temps = quant.backward_dequant_bytes(ctx)
    if not temps:
        return {}
    t = ctx.setup.batch_size * ctx.setup.seq_len
    k = max(m.in_features for m in ctx.spec.linears if m.name in ctx.quantized)
    stream = t * ctx.spec.arch.hidden_size * ctx.residual_bytes
    return {**back, "activations": before, "backward_temporaries": int(recompute) + stream,
            "dequant_temporaries": temps + t * k * 2}


def _recompute_end(ctx: Ctx, back: dict, casts: dict, before: int, rows) -> dict[str, int]:
    """The last block's recompute where it stops, at its MLP output projection, as phase components; {} without
    checkpointing.

    All it saves, the probabilities it keeps named to its end (forward_block.held_probs_bytes), and what the early
    stop holds beyond the saves (recompute_stop.stop_bytes: the MLP's input and product, the projection's output and
    LoRA cast, the gradients that triggered the recompute).
    """
    if not ctx.setup.grad_ckpt or not rows:
        return {}
    last = rows[-1]
    held = forward_block.held_probs_bytes(ctx)
    if not held and not recompute_stop.dense(ctx, last.blk):
        return {}  # elsewhere (MoE) the MLP product's backward holds more, unless probabilities are held
    stop = recompute_stop.stop_bytes(ctx, last.blk, last.tokens, act._lora_names(ctx))
    return {**back, **casts, "activations": before,
            "backward_temporaries": int(block_ends.largest_recompute_bytes(ctx, rows)) + held + stop}


def _mlp_moment(ctx: Ctx, end, before: int, recompute: float, temps: int) -> dict[str, int]:
    """An end block's MLP product backward: its activations and backward temporaries.

    `before` (the activations of the blocks before it and of the embeddings), the block's own saves less what its
    MLP output projection saved and its backward freed (block_ends.EndBlock.mlp_out; under checkpointing
    `recompute`, which already excludes it), and the working gradients.
    """
    if ctx.setup.grad_ckpt:
        return {"activations": before, "backward_temporaries": int(recompute) + temps}
    freed = end.mlp_out if end else 0
    return {"activations": int(before - freed), "backward_temporaries": temps}


def _backward_end(ctx: Ctx, res: dict, grads: int, ends, bwd_work: int, temps: int, deq: int,
                  embeds: int) -> dict[str, int]:
    """The backward_end phase: the first recording block's MLP backward.

    Every gradient but the input embeddings' (_late_grad_bytes) and the block's own before its MLP output
    (block_ends.pending_grad_bytes), what the embeddings saved (`embeds`), the block's checkpoint input or saved
    activations (with the masks checkpointing keeps), its recompute and the working gradients.
    """
    late = _late_grad_bytes(ctx)
    if not ends:
        return {**res, "gradients": grads - late, "backward_temporaries": bwd_work, "dequant_temporaries": deq}
    first = ends[0]
    ckpt = ctx.setup.grad_ckpt
    before = int(embeds + (first.checkpointed if ckpt else first.full))
    return {**res, "gradients": grads - late - block_ends.pending_grad_bytes(ctx, first),
            "attention_mask": checkpointed_mask_bytes(ctx), "dequant_temporaries": deq,
            **_mlp_moment(ctx, first, before, first.recompute - first.mlp_out, temps)}


def _late_grad_bytes(ctx: Ctx) -> int:
    """Bytes of the gradients the backward makes only after the first block's.

    The input embeddings' (token and learned position tables outside the blocks) unless the output head is tied to
    them (its backward made that buffer already). The first block's recompute and working tensors never coexist
    with them; embedding_backward holds them.
    """

    if ctx.spec.arch.tie_word_embeddings or ctx.spec.arch.kind == "seq2seq":  # the decoder's embedding backward
        return 0  # writes the shared table's gradient before the encoder's blocks
    late = sum(numel(ctx, p) for p in ctx.spec.params
               if p.block is None and p.role in ("embedding", "pos_embedding") and p.name in ctx.trainable)
    return late * ctx.weight_bytes


def _frozen_backward_phase(ctx: Ctx, res: dict, grads: int, blocks: list) -> dict:
    """The frozen_backward phase: checkpointing below the first trainable block (layer freezing); {} otherwise.

    Every weight gradient exists while the backward still recomputes and back-propagates the frozen blocks for the
    input gradient (recording.input_grads): their checkpoint inputs, the largest one's recompute, its autocast
    copies and the working gradients.
    """
    keys, inputs, full = recording.frozen_tail(ctx, blocks)
    if not keys:
        return {}
    return {"frozen_backward": {**res, "gradients": grads, "activations": int(inputs),
                                "autocast_weight_copies": quant.largest_block_cast_bytes(ctx, keys),
                                "attention_mask": checkpointed_mask_bytes(ctx),
                                "backward_temporaries": int(full) + _backward_temp_bytes(ctx)}}


def _decoder_embedding_phase(ctx: Ctx, res: dict, grads: int, held: int, blocks, tied: int) -> dict:
    """The decoder_embedding_backward phase of encoder-decoders whose shared embedding trains (T5, BART).

    The decoder's embedding backward leaves its contribution in the engine's input buffer until the encoder's
    arrives at the very end, so the encoder's saved activations are still alive beside the decoder's gradients and
    that contribution (counted with the gradients: the shared table's). Where lm_head is tied to the table the
    engine first sums the decoder's contribution with lm_head's out of place (logits.tied_accumulation_bytes,
    `tied`: both and the sum). The phase applies with an untied head too.
    """
    if ctx.spec.arch.kind != "seq2seq" or not tied:
        return {}
    enc = [full if not ctx.setup.grad_ckpt else ck
           for (full, ck), blk in zip(blocks, layout.blocks(ctx.spec)) if blk.stack == "encoder"]
    later = 0 if held else weights.stack_trainable_bytes(ctx).get("encoder", 0)  # the encoder's do not exist yet
    summed = tied if ctx.spec.arch.tie_word_embeddings else 0
    return {"decoder_embedding_backward": {**res, "gradients": grads - later, "activations": int(sum(enc)),
                                           "autocast_weight_copies": quant.autocast_copy_bytes(ctx, stack="encoder"),
                                           "backward_temporaries": summed}}


def sharded_phases(ctx: Ctx, compute: Ctx) -> tuple[dict[str, dict[str, int]], dist.RankState]:
    """Per-rank phases under data parallelism.

    The activations, logits and temporaries of `compute` (the setup the engine really computes:
    dist.compute_setup) with the model state of dist.rank_state(ctx) in place of the single-GPU weights, gradients
    and optimizer state; gathered (unsharded) parameters in forward and backward.

    Returns:
        (phases, the rank's model state).
    """
    rs = dist.rank_state(ctx)
    phases = training_phases(compute)
    accum = ctx.setup.grad_accum > 1
    state = {"weights": rs.weights, "quant_state": 0, "lora_adapters": rs.lora_adapters,
             "optimizer_state": rs.master_and_optimizer, "comm_buffers": rs.comm_buffers}
    # ZeRO-3's flat gradient-partition buffer is allocated once, at init, and kept (stage3.py
    # grad_partitions_flat_buffer): it exists in the forward too
    early = rs.gradients if accum or ctx.setup.sharding == "zero3" else 0
    grads = {"forward": early, "backward_start": early}
    if ctx.setup.engine == "fsdp":
        # before the last block's backward ends no FSDP unit has reduce-scattered its gradients: the sharded gradients
        # exist only when accumulating; ZeRO-2 keeps its partition buffer between steps
        grads["attention_backward"] = early
    gathered = {"forward": rs.gathered_forward, "backward_start": rs.gathered_head,
                "lm_head_backward": rs.gathered_head, "backward_end": rs.gathered_backward_end,
                "embedding_backward": rs.gathered_backward_end, "decoder_embedding_backward": rs.gathered_backward,
                "attention_backward": rs.gathered_backward, "frozen_backward": rs.gathered_backward_end,
                "first_attention_backward": rs.gathered_backward_end, "backward_indexer": rs.gathered_backward,
                "encoder_backward": rs.gathered_backward,
                "optimizer_step": 0}
    out = {}
    for name, parts in phases.items():
        kind = "forward" if name.startswith("forward") else name  # forward_block, forward_indexer: in the forward
        # backward_start is the loss's side (its logits' gradients: the root alone gathered) or a block's recompute
        head_side = name != "backward_start" or parts.get("logits", 0) > 0
        parts = {**parts, **state, "gathered_params": gathered[kind] if head_side else rs.gathered_backward}
        if kind in grads:
            parts["gradients"] = grads[kind]
        elif name == "lm_head_backward":  # the head's unsharded gradient, before it is reduced
            parts["gradients"] = early + parts.get("gradients", 0)
        else:
            parts["gradients"] = rs.gradients
        if name == "embedding_backward" and ctx.setup.sharding == "zero3":
            # the tied table's whole 16-bit gradient, beside its two contributions, before it is reduce-scattered into
            # the partition
            parts["backward_temporaries"] = parts.get("backward_temporaries", 0) + lg.tied_table_bytes(compute)
        if name == "optimizer_step":
            parts["optimizer_temporaries"] = rs.step_temporaries
        elif kind != "forward":
            parts["comm_buffers"] = rs.comm_buffers + rs.comm_backward
        out[name] = parts
    return out, rs


def _larger(*items: tuple[str, int]) -> dict[str, int]:
    """The one (component, bytes) of several non-overlapping transients that is largest."""
    name, value = max(items, key=lambda kv: kv[1])
    return {name: value}


def _backward_temp_bytes(ctx: Ctx) -> int:
    """Working gradients inside one block's backward, at the larger of two moments.

    A gated MLP's product backward holds the residual stream's gradient and three intermediate-sized ones in the
    activations' dtype (the product's, and the two aten mul's backward writes for act(gate) and up while that input
    gradient is held), a plain MLP's activation backward two (fc2's input's and fc1's output's); the attention's
    backward the residual stream's and the normed input's gradients. With LoRA on fused experts, the gradient of the
    largest W + BA copy (moe.largest_expert_lora_copy_bytes). The MLP gradients are in act_bytes: fp32 under QLoRA.
    """
    a = ctx.spec.arch
    t = ctx.setup.batch_size * max(ctx.src_len, ctx.tgt_len)
    k = a.experts_per_token if a.num_experts else 1
    stream = a.hidden_size * ctx.residual_bytes
    mlp = (3 if a.mlp_gated else 2) * a.intermediate_size * k * ctx.act_bytes
    return t * (stream + max(stream, mlp, _linear_work(ctx))) + moe.largest_expert_lora_copy_bytes(ctx)


def _linear_work(ctx: Ctx) -> float:
    """Per token, what a linear-attention block's mixer holds in its backward beyond its saves.

    Measured per family: Arch.linear_work (linfacts.measure), the trained case where the blocks' base weights train.
    """

    a = ctx.spec.arch
    if not a.linear_work:
        return 0.0
    return a.linear_work[linear_case(ctx.act_bytes, ctx.setup.technique in ("full", "freeze"), ctx.mixed)]


def inference_phases(ctx: Ctx) -> dict[str, dict[str, int]]:
    """The phases of inference, each a dict of bytes per component.

    prefill: one layer's working set + the cache so far. decode: full cache + growth + last-token logits.
    """
    res = {**_resident(ctx), "autocast_weight_copies": quant.cached_cast_bytes(ctx)}  # mixed: cached casts
    kv = inf.kv_cache_bytes(ctx)
    deq = quant.dequant_temp_bytes(ctx)
    prompt = {**res, "kv_cache": inf.prompt_cache_bytes(ctx), "activations": inf.prefill_working_bytes(ctx),
              "dequant_temporaries": deq, "attention_mask": mask_bytes(ctx)}
    # an encoder-decoder's prompt call also runs its first decoder step (memplan.runtime.steps.inference_loop, as
    # generate does): the encoder output and the cross-attention cache of every layer, after the encoder's working set
    # is gone
    first_step = {**res, "kv_cache": inf.cross_cache_bytes(ctx), "activations": inf.encoder_output_bytes(ctx)}
    steps = {**res, "kv_cache": kv + inf.kv_growth_bytes(ctx), "logits": lg.inference_logits_bytes(ctx),
             "activations": inf.encoder_output_bytes(ctx)}
    # generate() runs its own prompt pass first (validate measures it in its decode phase), with batch-sized positions
    generated = {**prompt, "activations": prompt["activations"] + inf.generate_position_bytes(ctx)}
    return {
        "prefill": largest(prompt, first_step),
        "decode": largest(steps, generated) if ctx.spec.arch.kind == "causal" else steps,
    }
