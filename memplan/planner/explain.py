"""Explaining a plan: short labels for setups, why each alternative lost, and what would make a plan fit when
nothing does. Used by memplan.planner.search.plan (and the reports, through describe)."""
from __future__ import annotations

from memplan.planner.types import Candidate
from memplan.setup import Setup, sharding_label
from memplan.units import fmt_gib


def describe(s: Setup) -> str:
    """A short human label: 'LoRA r=64 all-linear, bf16, adamw-fused, checkpointing, micro-batch 4 x 8'."""
    tech = {"full": "full fine-tune", "lora": "LoRA", "qlora": "QLoRA", "freeze": "freeze"}[s.technique]
    parts = [tech]
    if s.technique in ("lora", "qlora"):
        parts[0] += f" r={s.lora_r} " + ("all-linear" if s.lora_targets == "all-linear" else
                                          ",".join(s.lora_targets) if s.lora_targets else "default targets")
    if s.trainer != "hf":  # TRL's trainer and the fields that set its memory
        parts[0] = f"TRL {s.trainer.upper()} " + parts[0]
        if s.packing or s.padding_free:
            parts.append("packed" if s.packing else "padding-free")
        if s.precompute_ref_log_probs:
            parts.append("precomputed reference")
        if s.activation_offloading:
            parts.append("activation offloading")
        if s.trainer == "grpo":
            parts.append(f"{s.num_generations} generations x {s.max_completion_length} tokens"
                         + (f", {s.steps_per_generation} steps per generation" if s.steps_per_generation else "")
                         + (f", beta {s.beta:g}" if s.beta else "")
                         + (f", vLLM {s.vllm_mode}" + (f" {s.vllm_gpu_memory_utilization:.0%}"
                                                       if s.vllm_mode == "colocate" else "") if s.use_vllm else ""))
    if s.quant:
        parts.append(s.quant + (" + double quant" if s.double_quant else ""))
    if s.technique == "freeze":
        parts.append(f"trainable {s.trainable or 1}")
    parts += [s.precision, s.optimizer]
    if s.grad_ckpt:
        parts.append("checkpointing")
    if s.sharding != "none":
        parts.append(sharding_label(s))
    parts.append(f"micro-batch {s.batch_size} x {s.grad_accum}" + (" (padded)" if s.padded else ""))
    return ", ".join(parts)


def _speed_reason(s: Setup, best: Setup) -> str:
    what = "recomputes the forward in backward, " if s.grad_ckpt else ""
    if s.technique == "full" and best.technique != "full":
        what += "weight gradients for every parameter, "
    return f"slower: {what}micro-batch {s.batch_size} x {s.grad_accum} steps"


def lost_reason(c: Candidate, best: Candidate, prefer: str) -> str:
    """Why a fitting candidate ranks below the chosen one, in the terms of the preference."""
    s, b = c.setup, best.setup
    if prefer == "memory" and c.need_bytes != best.need_bytes:
        return f"needs {fmt_gib(c.need_bytes - best.need_bytes)} more"
    if prefer == "speed" and c.key[:1] != best.key[:1]:
        return _speed_reason(s, b)
    if s.technique != b.technique:
        return f"{s.technique} ranks below {b.technique} for quality"
    if s.precision != b.precision:
        return f"precision {s.precision} ranks below {b.precision}"
    if s.lora_targets != b.lora_targets:
        return "fewer LoRA targets (peft's default, attention only)"
    if s.optimizer != b.optimizer:
        return f"{s.optimizer} ranks below {b.optimizer}"
    if s.lora_r != b.lora_r and s.technique in ("lora", "qlora"):
        return f"rank {s.lora_r} instead of {b.lora_r}"
    return _speed_reason(s, b)


