"""TRL's trainers (TRL 1.16): the policy's training step on the rows TRL runs, and the phases TRL adds.

SFTTrainer: the step of transformers' Trainer through TRL's fused LM head (memory.fused_head); padding-free
batches (packing with the default BFD strategy, or padding_free) are one row of batch_size x seq_len tokens
(sft_trainer.py DataCollatorForLanguageModeling), attending within each document: flash attention through
cu_seqlens, sdpa and eager through the block-diagonal [1, 1, T, T] mask transformers builds from position_ids
(masking_utils.find_packed_sequence_indices), which the padded-batch mask accounting covers.
DPOTrainer: chosen and rejected concatenated, 2 x batch_size rows of seq_len; the reference forward runs under
no_grad after the policy's forward, while the policy's graph is alive (dpo_trainer.py _compute_loss), on a second
copy of the model (full fine-tuning: from_pretrained in the policy's dtype) or the same weights with the adapter
disabled (peft); none with precompute_ref_log_probs.
GRPOTrainer: generate() of batch_size x grad_accum completions (steps_per_generation = gradient_accumulation_steps)
of prompt + max_completion_length tokens with the KV cache and the optimizer state alive, gradient checkpointing off
(models/utils.py unwrap_model_for_generation); with beta > 0 the reference log-probs, per_device_train_batch_size
rows at a time under no_grad; then the policy's step on batch_size rows, scoring the completion tokens only. vLLM
(use_vllm) generates instead: in another process (server) or colocated, where it takes vllm_gpu_memory_utilization
of the card's total memory (vllm/v1/worker/gpu_worker.py determine_available_memory: requested_memory = total_memory
x gpu_memory_utilization, for its weights, activations and KV cache).
"""
from __future__ import annotations


from memplan import libs
from memplan.estimator.memory import fused_head, quant
from memplan.estimator.memory import inference as inf
from memplan.estimator.memory.context import Ctx, resolve
from memplan.estimator.memory.weights import total_numel, weights_bytes
from memplan.estimator.phases import inference_phases, training_phases
from memplan.model.compat import attn_impl
from memplan.setup import (Setup, generation_steps, needs_reference_model, prompt_tokens, recomputes_old_logps,
                           trainer_rows)

#: inference components that are the model's own resident state: the training step's resident replaces them
_RESIDENT = ("weights", "quant_state", "lora_adapters", "optimizer_state", "cublas_workspace")


def rows_setup(spec, s: Setup) -> Setup:
    """The setup of the rows the policy's training forward runs (setup.trainer_rows)."""
    return trainer_rows(s, attn_impl(spec, s))


def reference_weight_bytes(ctx: Ctx) -> int:
    """The reference model's weights where it is a second model (setup.needs_reference_model): the policy's
    bytes, in its dtype."""
    return weights_bytes(ctx) if needs_reference_model(ctx.setup) else 0


def _no_grad_setup(s: Setup, batch: int, prompt: int, new: int) -> Setup:
    """An inference setup for a no-grad pass of the policy's model: generation, or a scoring forward (new=0).

    peft's generate() runs the base model's forward, which accelerate's autocast wrapper (on the PeftModel's forward)
    does not cover: LoRA/QLoRA generate in the weights' dtype; full fine-tuning under the wrapper in the compute
    dtype."""
    precision = s.precision
    if new and s.technique in ("lora", "qlora") and s.mixed:
        precision = s.weight_dtype
    return Setup(mode="infer", precision=precision, quant=s.quant, double_quant=s.double_quant, batch_size=batch,
                 seq_len=prompt, prompt_len=prompt, new_tokens=new, attn_impl=s.attn_impl, padded=s.padded,
                 task=s.task)


def _no_grad_forward_bytes(ctx: Ctx, trained: bool = False) -> int:
    """A scoring pass under no_grad on the rows of `ctx`: the largest of a block's working set and the fused head's,
    and the cached autocast casts of a model whose weights keep requires_grad: a separate reference model (TRL
    leaves it so), or the policy itself when fully fine-tuned (`trained`: GRPO's old log-probs)."""
    spec, s = ctx.spec, ctx.setup
    infer = resolve(spec, _no_grad_setup(s, s.batch_size, ctx.src_len, 0))
    grads = needs_reference_model(s) or (trained and s.technique in ("full", "freeze"))
    casts = quant.cached_cast_bytes(infer, requires_grad=grads, head=False)
    return max(inf.prefill_working_bytes(infer), fused_head.reference_bytes(ctx)) + casts


def trl_phases(ctx: Ctx) -> dict[str, dict[str, int]]:
    """The phases of a TRL step (ctx resolved on rows_setup): the policy's training phases, every one with the
    reference model, and the reference forward (dpo) or generation and reference scoring (grpo)."""
    s = ctx.setup
    ref = reference_weight_bytes(ctx)
    phases = {name: {**parts, "reference_model": ref} for name, parts in training_phases(ctx).items()}
    if s.trainer == "dpo" and not s.precompute_ref_log_probs:
        forward = dict(phases["forward"])
        forward.pop("dequant_temporaries", None)
        phases["reference_forward"] = {**forward, "logits": fused_head.saved_bytes(ctx),
                                       "reference_forward": _no_grad_forward_bytes(ctx)}
    if s.trainer == "grpo":
        resident = {k: phases["optimizer_step"][k] for k in _RESIDENT if k in phases["optimizer_step"]}
        resident["reference_model"] = ref
        if generation_steps(s) < s.grad_accum:  # mid-window: the accumulated gradients are alive
            resident["gradients"] = phases["optimizer_step"]["gradients"]
        if not s.use_vllm:
            gen = resolve(ctx.spec, _no_grad_setup(s, s.batch_size * generation_steps(s), prompt_tokens(s),
                                                   s.max_completion_length))
            for name, parts in inference_phases(gen).items():
                phases[f"generation_{name}"] = {**resident, **{k: v for k, v in parts.items() if k not in _RESIDENT}}
        if s.beta > 0:
            phases["reference_forward"] = {**resident, "reference_forward": _no_grad_forward_bytes(ctx)}
        if recomputes_old_logps(s):
            phases["old_logps_forward"] = {**resident, "reference_forward": _no_grad_forward_bytes(ctx, trained=True)}
    return phases


def vllm_weight_bytes(ctx: Ctx) -> int:
    """The weights vLLM loads in its own engine: every parameter in 16 bit (dtype "auto" from a 16-bit checkpoint)."""
    return 2 * total_numel(ctx)


def vllm_bytes(s: Setup) -> int | None:
    """What colocated vLLM takes of the card planned for: vllm_gpu_memory_utilization x its total memory; 0 without
    a colocated vLLM, None when no card is named (the total cannot be known)."""
    if s.trainer != "grpo" or not s.use_vllm or s.vllm_mode != "colocate":
        return 0
    total = libs.assumed("gpu_memory_bytes")
    return int(s.vllm_gpu_memory_utilization * int(total)) if total else None


def notes(ctx: Ctx, s: Setup) -> list[str]:
    """What the estimate assumed about the TRL step, for people."""
    out = [f"TRL {s.trainer.upper()}Trainer (TRL 1.16): tokens scored by its fused LM head in "
           f"{fused_head.TOKEN_CHUNK} x {fused_head.VOCAB_CHUNK} tiles, no logits"]
    if s.trainer == "sft" and (s.packing or s.padding_free):
        out.append(f"padding-free: one row of {ctx.setup.seq_len} tokens" +
                   ("" if not ctx.setup.padded else f", a [1, 1, {ctx.setup.seq_len}, {ctx.setup.seq_len}] block-"
                    "diagonal mask ({ctx.attn_impl}; flash_attention_2 needs none)"))
    if s.trainer == "dpo":
        ref = ("none (precomputed log-probs)" if s.precompute_ref_log_probs else
               "a second copy of the model" if reference_weight_bytes(ctx) else "the base with the adapter disabled")
        out.append(f"DPO: {ctx.setup.batch_size} rows (chosen + rejected); reference: {ref}")
    if s.trainer == "grpo":
        gen = ("vLLM in another process (server)" if s.use_vllm and s.vllm_mode == "server" else
               f"vLLM colocated ({s.vllm_gpu_memory_utilization:.0%} of the card)" if s.use_vllm else
               f"generate() of {s.batch_size * generation_steps(s)} completions x ({prompt_tokens(s)} + "
               f"{s.max_completion_length}) tokens")
        out.append(f"GRPO: {gen}; reference: " + ("none (beta = 0)" if s.beta == 0 else
                                                 "a second copy" if reference_weight_bytes(ctx) else "adapter off"))
        share = vllm_bytes(s)
        if share is None:
            out.append("not in the device total: colocated vLLM's vllm_gpu_memory_utilization x the card's memory "
                       "(name the card with --gpu)")
        elif share and share < vllm_weight_bytes(ctx):
            out.append(f"vLLM's share ({share / 2**30:.1f} GiB) cannot hold the model's 16-bit weights "
                       f"({vllm_weight_bytes(ctx) / 2**30:.1f} GiB), let alone its KV cache: vLLM will refuse to start; "
                       "raise --vllm-gpu-memory-utilization")
    return out
