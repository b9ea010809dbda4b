"""The planner's candidates and how it orders them: the searched values of each Setup field, the quality ranking
and the relative speed score (memplan.planner.search runs the search over them; docs/PLANNER.md has the rationale).

Quality ranks full > LoRA > QLoRA > freeze (freeze trains only the top blocks: the weakest adaptation), mixed
precision = fp32 master weights > fp32 compute > pure 16-bit weights, all-linear > peft's default (attention)
targets, AdamW > 8-bit AdamW > paged 8-bit AdamW > Adafactor, then rank: with all-linear targets any rank from 16
up is as good (QLoRA), the smallest first so the memory left buys a larger micro-batch; on fewer targets, larger
(quality_key cites the evidence).

Speed is a relative score used only to order candidates (never reported as a prediction):
  efficiency(micro-batch tokens) / step cost, efficiency = min(tokens, 4096) / 4096 (a micro-batch of >= 4096
  tokens is taken to saturate the GPU's matmuls), step cost in forward-pass units = 1 forward + 1 input-gradient
  backward + the trainable fraction of the weight-gradient backward (backward = 2 forwards: the 6N FLOPs/token
  rule, Kaplan et al. 2020, arXiv:2001.08361 sec. 2.1) + 1 recomputed forward with gradient checkpointing.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

from memplan.errors import SetupError
from memplan.setup import Setup, distributed_problems

TECHNIQUE_ORDER = ("full", "lora", "qlora", "freeze")
RANKS = (256, 128, 64, 32, 16, 8, 4)
#: the smallest rank QLoRA's comparison found as good as any with all layers adapted (arXiv:2305.14314 sec. 4 and
#: fig. 4: r in 8-256 within noise on LLaMA-7B; 16 leaves a margin below which docs/PLANNER.md keeps larger first)
ALL_LINEAR_RANK_FLOOR = 16
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


def _precisions(technique: str, bf16: bool) -> tuple[str, ...]:
    """Per technique, in quality order. Pure fp16 weights are never trained in full (fp16 weight updates underflow;
    Trainer refuses to unscale fp16 gradients); QLoRA computes in bf16/fp16 over its 4-bit base."""
    half = "bf16" if bf16 else "fp16"
    if technique == "qlora":
        return (half,)
    if technique in ("full", "freeze"):
        return (f"{half}-mixed", "fp32") + (("bf16",) if bf16 else ())
    return (f"{half}-mixed", "fp32", half)


def world_size(pinned: dict) -> int:
    """The GPU count the pins ask for (1 when none is pinned)."""
    return pinned.get("num_gpus", 1) * pinned.get("num_nodes", 1)


def _shardings(pinned: dict) -> tuple[tuple[str, str], ...]:
    """(sharding, offload) pairs to search: none on one GPU unless pinned, SHARDING_ORDER across several."""
    pairs = tuple((sh, off) for sh, off, _ in SHARDING_ORDER) if world_size(pinned) > 1 else (("none", "none"),)
    if "sharding" in pinned:  # invalid offloads for it are dropped with the Setup's validation
        pairs = tuple((pinned["sharding"], off) for off in ("none", "optimizer", "params+optimizer"))
    if "offload" in pinned:
        pairs = tuple((sh, pinned["offload"]) for sh in dict.fromkeys(sh for sh, _ in pairs))
    return pairs


def _searched(pinned: dict, name: str, values: tuple) -> tuple:
    """A searched dimension: its pinned value alone, else `values` in quality order."""
    return (pinned[name],) if name in pinned else values


def candidate_fields(bf16: bool, pinned: dict) -> list[dict]:
    """Every combination of the searched fields (batch aside), pins applied, in quality order. A pinned field is a
    dimension of one value, so no combination repeats."""
    out: list[dict] = []
    techniques = (pinned["technique"],) if "technique" in pinned else TECHNIQUE_ORDER
    if "technique" not in pinned and pinned.keys() & {"lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant",
                                                      "use_dora"}:
        techniques = ("lora", "qlora")  # a LoRA or quantization pin implies an adapter technique
    if "technique" not in pinned and "trainable" in pinned:
        techniques = ("freeze",)
    rest = {k: v for k, v in pinned.items() if k not in ("batch_size", "grad_accum")}
    for tech in techniques:
        lora = tech in ("lora", "qlora")
        ranks = _searched(pinned, "lora_r", RANKS) if lora else (None,)
        targets = _searched(pinned, "lora_targets", TARGET_ORDER) if lora else (None,)
        for prec, r, target, optim, ckpt, (sharding, offload) in itertools.product(
                _searched(pinned, "precision", _precisions(tech, bf16)), ranks, targets,
                _searched(pinned, "optimizer", OPTIMIZER_ORDER), _searched(pinned, "grad_ckpt", (False, True)),
                _shardings(pinned)):
            f = {"technique": tech, "precision": prec, "optimizer": optim, "grad_ckpt": ckpt, "sharding": sharding,
                 "offload": offload}
            if lora:  # alpha = 2r: a common scaling choice; no memory effect
                f.update(lora_r=r, lora_targets=target, lora_alpha=2 * r)
            if tech == "qlora":
                f.update(quant="nf4", double_quant=True)
            f.update(rest)
            out.extend(_reference_strategies(f, pinned))
    return out


def _reference_strategies(f: dict, pinned: dict) -> list[dict]:
    """DPO's reference unpinned: in training (TRL's default) first, then precomputed log-probs (the same loss; no
    reference forward in the step, nor a second model for full fine-tuning)."""
    if f.get("trainer") != "dpo" or "precompute_ref_log_probs" in pinned:
        return [f]
    return [f, {**f, "precompute_ref_log_probs": True}]


def _field(f: Setup | Mapping, name: str):
    """A field of a Setup, or of a candidate's fields (absent = the Setup default None)."""
    return f.get(name) if isinstance(f, Mapping) else getattr(f, name)


#: pins that are not searched: every candidate carries them
_BASE_PINS = ("seq_len", "target_len", "lora_alpha", "lora_dropout", "trainable", "attn_impl", "added_tokens",
              "num_gpus", "num_nodes", "padded", "use_dora")


def grpo_group_step(pinned: Mapping, other: int) -> int:
    """GRPO's generation batch (micro-batch x accumulation, TRL's steps_per_generation = gradient_accumulation_steps)
    must divide by num_generations, as GRPOTrainer requires: with one factor `other`, the other comes in multiples
    of this. 1 for the other trainers, and where a pinned steps_per_generation sets the generation batch itself."""
    if pinned.get("trainer") != "grpo" or pinned.get("steps_per_generation"):
        return 1
    n = pinned.get("num_generations", 8)
    return n // math.gcd(n, other)


def grpo_accum(pinned: Mapping, batch: int, accum: int = 1) -> int:
    """The smallest accumulation >= `accum` at which a GRPO micro-batch's generation batch (batch x accum
    completions, TRL's steps_per_generation = gradient_accumulation_steps) divides by num_generations: the rule
    GRPOTrainer enforces. `accum` itself for the other trainers."""
    step = grpo_group_step(pinned, batch)
    return math.ceil(accum / step) * step


def grpo_batch_unit(pinned: Mapping) -> int:
    """The micro-batches a search may try come in multiples of this: 1, but for GRPO with the accumulation pinned
    the smallest micro-batch that holds whole groups (grpo_group_step)."""
    return grpo_group_step(pinned, pinned["grad_accum"]) if pinned.get("grad_accum") else 1


class Pool:
    """The candidates of one search, micro-batch 1 unless pinned, in quality order: their fields (enough to rank
    them: quality_key) and their Setups, each built and validated on first use (a search ranks far more candidates
    than it estimates). `keep` filters the fields."""

    def __init__(self, seq_len: int, bf16: bool, pinned: dict, keep: Callable[[dict], bool] | None = None):
        base = {k: v for k, v in pinned.items() if k in _BASE_PINS}
        # GRPO's micro-batch 1 accumulates num_generations steps: its generation batch must divide into prompts;
        # with the accumulation pinned, the micro-batch holds whole groups instead
        ga = pinned.get("num_generations", 8) if pinned.get("trainer") == "grpo" else 1
        base.update(mode="train", batch_size=pinned.get("batch_size", grpo_batch_unit(pinned)),
                    grad_accum=pinned.get("grad_accum", ga))
        base.setdefault("seq_len", seq_len)
        world = world_size(pinned)
        self.fields: list[dict] = []
        self.error: SetupError | None = None  # the first invalid candidate's: it explains an empty search
        self._built: dict[int, Setup | None] = {}
        for f in candidate_fields(bf16, pinned):
            if keep is not None and not keep(f):
                continue
            if isinstance(world, int):  # half the sharded candidates (8-bit optimizers, offload) fail here: cheaply
                problems = distributed_problems("train", world, f["sharding"], f["offload"], f["optimizer"])
                if problems:
                    self.error = self.error or SetupError(list(problems))
                    continue
            self.fields.append({**base, **f})

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, i: int) -> Setup | None:
        """Candidate i's Setup, None when its combination is invalid."""
        if i not in self._built:
            try:
                self._built[i] = Setup(**self.fields[i])
            except SetupError as e:
                self.error = self.error or e
                self._built[i] = None
        return self._built[i]

    def setups(self):
        """The valid Setups in order."""
        return (s for s in map(self.__getitem__, range(len(self))) if s is not None)


def quality_key(f: Setup | Mapping) -> tuple:
    """Smaller is better: technique, precision class, wider LoRA targets, optimizer, larger rank. `f`: a Setup,
    or a candidate's fields (Pool ranks candidates before it builds their Setups).

    Targets before rank: "the most critical LoRA hyperparameter is how many LoRA adapters are used in total ...
    LoRA r is unrelated to final performance if LoRA is used on all layers" (QLoRA, arXiv:2305.14314 sec. 4).
    So with all-linear targets every rank from ALL_LINEAR_RANK_FLOOR up ranks alike, the smallest first (the rest of
    the memory goes to the micro-batch: throughput), below it lower; on fewer targets a larger rank ranks higher.
    8-bit AdamW matches 32-bit AdamW's results (arXiv:2110.02861) but ranks after it, paged after unpaged (same
    math, slower when paging), Adafactor (factored second moment, arXiv:1804.04235) last. DPO's precomputed reference
    (the same loss) ranks after the reference computed in the step, TRL's default, at equal quality."""
    precision, technique, optimizer = _field(f, "precision"), _field(f, "technique"), _field(f, "optimizer")
    prec = 0 if precision.endswith("-mixed") else (1 if precision == "fp32" else 2)
    lora = technique in ("lora", "qlora")
    targets = (0 if _field(f, "lora_targets") == "all-linear" else 1) if lora else 0
    optim = OPTIMIZER_ORDER.index(optimizer) if optimizer in OPTIMIZER_ORDER else len(OPTIMIZER_ORDER)
    return (TECHNIQUE_ORDER.index(technique), prec, targets, optim, rank_key(_field(f, "lora_r"), targets) if lora
            else (0, 0), _field(f, "quant") is not None, bool(_field(f, "precompute_ref_log_probs")))


def rank_key(r: int, targets: int) -> tuple[int, int]:
    """The rank's place in quality_key: all-linear (targets 0) ranks r >= ALL_LINEAR_RANK_FLOOR as one tier,
    smallest first; peft's default targets, larger first."""
    if targets == 0:
        return (0, r) if r >= ALL_LINEAR_RANK_FLOOR else (1, -r)
    return (0, -r)


def speed_score(f: Setup | Mapping, trainable_fraction: float, tokens_per_sample: int,
                batch: int | None = None) -> float:
    """Relative throughput per GPU (higher is faster) at micro-batch `batch` (default the Setup's); `f` as for
    quality_key; see the module docstring and SHARDING_ORDER."""
    eff = min((batch or _field(f, "batch_size")) * tokens_per_sample, SATURATING_TOKENS) / SATURATING_TOKENS
    cost = 2.0 + trainable_fraction + (1.0 if _field(f, "grad_ckpt") else 0.0)
    return eff / cost * SHARDING_SPEED.get((_field(f, "sharding"), _field(f, "offload")), 1.0)


def split_batch(effective: int, max_micro: int) -> tuple[int, int]:
    """An effective batch split into micro-batches: the largest divisor of `effective` not above max_micro when
    that loses at most half of max_micro (the effective batch is then exact), else max_micro with enough steps to
    reach at least `effective`.

    Returns:
        (micro-batch, accumulation steps)."""
    max_micro = max(1, max_micro)
    best = max(d for d in range(1, min(effective, max_micro) + 1) if effective % d == 0)
    if best * 2 >= min(max_micro, effective):
        return best, effective // best
    return max_micro, math.ceil(effective / max_micro)
