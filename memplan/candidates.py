"""The planner's candidates and how it orders them: the searched values of each Setup field, the quality ranking
and the relative speed score (memplan.search runs the search over them; docs/PLANNER.md has the rationale).

Quality ranks full > LoRA > QLoRA > freeze (freeze trains only the top blocks: the weakest adaptation), mixed
precision = fp32 master weights > fp32 compute > pure 16-bit weights, all-linear > peft's default (attention)
targets, AdamW > 8-bit AdamW > paged 8-bit AdamW > Adafactor, larger rank (quality_key cites the evidence).

Speed is a relative score used only to order candidates (never reported as a prediction):
  efficiency(micro-batch tokens) / step cost, efficiency = min(tokens, 4096) / 4096 (a micro-batch of >= 4096
  tokens is taken to saturate the GPU's matmuls), step cost in forward-pass units = 1 forward + 1 input-gradient
  backward + the trainable fraction of the weight-gradient backward (backward = 2 forwards: the 6N FLOPs/token
  rule, Kaplan et al. 2020, arXiv:2001.08361 sec. 2.1) + 1 recomputed forward with gradient checkpointing.
"""
from __future__ import annotations

import itertools
import math

from memplan.setup import Setup

TECHNIQUE_ORDER = ("full", "lora", "qlora", "freeze")
RANKS = (256, 128, 64, 32, 16, 8, 4)
TARGET_ORDER = ("all-linear", None)  # None = peft's default targets for the model type (attention projections)
OPTIMIZER_ORDER = ("adamw-fused", "adamw-8bit", "paged-adamw-8bit", "adafactor")
SATURATING_TOKENS = 4096
#: across several GPUs, (sharding, offload) in speed order. Relative step-time factors order candidates only (never
#: reported): ZeRO-1/2 move as much data as DDP's all-reduce (2 Psi); ZeRO-3/FSDP full shard add a parameter
#: all-gather per forward and backward (3 Psi, 1.5x: ZeRO paper arXiv:1910.02054 sec. 7.2-7.3); CPU offload runs
#: the optimizer step on the CPU over PCIe (ZeRO-Offload, arXiv:2101.06840 sec. 4), parameter offload also streams
#: the weights every step.
#: Searched unpinned: DDP (the simplest), ZeRO-2 (same traffic, sharded optimizer state and gradients: it dominates
#: ZeRO-1), FSDP full shard and ZeRO-3, then ZeRO-3 with optimizer / parameter offload. A pinned --sharding also
#: tries its offload variants; every pair has a speed factor.
SHARDING_ORDER: tuple[tuple[str, str, float], ...] = (
    ("ddp", "none", 1.0), ("zero2", "none", 0.99), ("fsdp-full-shard", "none", 0.9), ("zero3", "none", 0.9),
    ("zero3", "optimizer", 0.55), ("zero3", "params+optimizer", 0.35))
SHARDING_SPEED = {**{(sh, off): f for sh, off, f in SHARDING_ORDER}, ("zero1", "none"): 1.0,
                  ("fsdp-shard-grad-op", "none"): 0.95, ("zero1", "optimizer"): 0.6, ("zero2", "optimizer"): 0.6,
                  ("fsdp-full-shard", "params+optimizer"): 0.35}
#: the search dimensions: the Setup fields the planner chooses (the rest come from pins or Setup defaults)
SEARCHED = ("technique", "precision", "quant", "double_quant", "lora_r", "lora_targets", "optimizer", "grad_ckpt",
            "batch_size", "grad_accum", "sharding", "offload")


def _precisions(technique: str, bf16: bool) -> tuple[str, ...]:
    """Per technique, in quality order. Pure fp16 weights are never trained in full (fp16 weight updates underflow;
    Trainer refuses to unscale fp16 gradients); QLoRA computes in bf16/fp16 over its 4-bit base."""
    half = "bf16" if bf16 else "fp16"
    if technique == "qlora":
        return (half,)
    if technique in ("full", "freeze"):
        return (f"{half}-mixed", "fp32") + (("bf16",) if bf16 else ())
    return (f"{half}-mixed", "fp32", half)


def _world(pinned: dict) -> int:
    """The GPU count the pins ask for (1 when none is pinned)."""
    return pinned.get("num_gpus", 1) * pinned.get("num_nodes", 1)


def _shardings(pinned: dict) -> tuple[tuple[str, str], ...]:
    """(sharding, offload) pairs to search: none on one GPU unless pinned, SHARDING_ORDER across several."""
    pairs = tuple((sh, off) for sh, off, _ in SHARDING_ORDER) if _world(pinned) > 1 else (("none", "none"),)
    if "sharding" in pinned:  # invalid offloads for it are dropped with the Setup's validation
        pairs = tuple((pinned["sharding"], off) for off in ("none", "optimizer", "params+optimizer"))
    if "offload" in pinned:
        pairs = tuple((sh, pinned["offload"]) for sh in dict.fromkeys(sh for sh, _ in pairs))
    return pairs


def candidate_fields(bf16: bool, pinned: dict) -> list[dict]:
    """Every combination of the searched fields (batch aside), pins applied, deduplicated, in quality order."""
    out: list[dict] = []
    seen: set = set()
    techniques = (pinned["technique"],) if "technique" in pinned else TECHNIQUE_ORDER
    if "technique" not in pinned and pinned.keys() & {"lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant"}:
        techniques = ("lora", "qlora")  # a LoRA or quantization pin implies an adapter technique
    if "technique" not in pinned and "trainable" in pinned:
        techniques = ("freeze",)
    for tech in techniques:
        lora = tech in ("lora", "qlora")
        for prec in _precisions(tech, bf16):
            for r in RANKS if lora else (None,):
                for targets in TARGET_ORDER if lora else (None,):
                    for optim, ckpt, (sharding, offload) in itertools.product(OPTIMIZER_ORDER, (False, True),
                                                                               _shardings(pinned)):
                            f = {"technique": tech, "precision": prec, "optimizer": optim, "grad_ckpt": ckpt,
                                 "sharding": sharding, "offload": offload}
                            if lora:  # alpha = 2r: a common scaling choice; no memory effect
                                f.update(lora_r=r, lora_targets=targets, lora_alpha=2 * r)
                            if tech == "qlora":
                                f.update(quant="nf4", double_quant=True)
                            f.update({k: v for k, v in pinned.items() if k not in ("batch_size", "grad_accum")})
                            sig = tuple(sorted((k, repr(v)) for k, v in f.items()))
                            if sig not in seen:
                                seen.add(sig)
                                out.append(f)
    return out


def quality_key(s: Setup) -> tuple:
    """Smaller is better: technique, precision class, wider LoRA targets, optimizer, larger rank.

    Targets before rank: "the most critical LoRA hyperparameter is how many LoRA adapters are used in total ...
    LoRA r is unrelated to final performance if LoRA is used on all layers" (QLoRA, arXiv:2305.14314 sec. 4).
    8-bit AdamW matches 32-bit AdamW's results (arXiv:2110.02861) but ranks after it, paged after unpaged (same
    math, slower when paging), Adafactor (factored second moment, arXiv:1804.04235) last."""
    prec = 0 if s.mixed else (1 if s.precision == "fp32" else 2)
    lora = s.technique in ("lora", "qlora")
    targets = (0 if s.lora_targets == "all-linear" else 1) if lora else 0
    optim = OPTIMIZER_ORDER.index(s.optimizer) if s.optimizer in OPTIMIZER_ORDER else len(OPTIMIZER_ORDER)
    tech = TECHNIQUE_ORDER.index(s.technique)
    return (tech, prec, targets, optim, -(s.lora_r if lora else 0), s.quant is not None)


def speed_score(s: Setup, trainable_fraction: float, tokens_per_sample: int) -> float:
    """Relative throughput per GPU (higher is faster); see the module docstring and SHARDING_ORDER."""
    eff = min(s.batch_size * tokens_per_sample, SATURATING_TOKENS) / SATURATING_TOKENS
    cost = 2.0 + trainable_fraction + (1.0 if s.grad_ckpt else 0.0)
    return eff / cost * SHARDING_SPEED.get((s.sharding, s.offload), 1.0)


def split_batch(effective: int, max_micro: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for an effective batch: the largest divisor of `effective` not above
    max_micro when that loses at most half of max_micro (the effective batch is then exact), else max_micro with
    enough steps to reach at least `effective`."""
    max_micro = max(1, max_micro)
    best = max(d for d in range(1, min(effective, max_micro) + 1) if effective % d == 0)
    if best * 2 >= min(max_micro, effective):
        return best, effective // best
    return max_micro, math.ceil(effective / max_micro)
