"""The remedies memplan doctor ranks and combines: each one change to a training setup, estimated against the budget.

Ranking rule for single remedies that make the setup fit (rank_key; smaller is better):
  1. size, how big a change it is: 1 a runtime knob that keeps the training math (sdpa attention, a smaller
     micro-batch with more gradient accumulation - same effective batch -, gradient checkpointing); 2 optimizer or
     precision (mixed precision, 8-bit / paged 8-bit AdamW, fewer LoRA targets, smaller LoRA rank, 16-bit weights,
     Adafactor); 3 technique (LoRA on a 16-bit base, freezing all but the last block); 4 QLoRA (a 4-bit base);
     5 shorter sequences (changes the data: samples are truncated).
  2. cost: among size-1 knobs the smaller slowdown by the planner's relative throughput (candidates.speed_score: a
     recomputed forward, or micro-batches below ~4096 tokens); among larger changes the REMEDIES order, which lists
     each size's remedies by increasing quality cost.
  3. the lower new need (the larger margin).
Remedies that do not fit follow, most memory saved first. When none fits alone, remedies are combined (combine):
greedily - while it does not fit, add the best-ranked remedy that makes it fit, else the one saving most among the
smallest sizes - then improved one removal or swap at a time while a smaller combination still fits (smaller: the
largest change first, then fewer and smaller other changes, then the faster result).
"Fits" is the test fit and plan use (memplan.planner.budget): what the setup needs within the GPU memory less the
headroom.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memplan.planner.budget import fits, need_bytes
from memplan.errors import MemplanError
from memplan.planner.fit_table import largest_fitting, max_batch_size
from memplan.model.compat import LIGER_ESTIMATED, default_attn_impl, sdpa_supported
from memplan.planner.candidates import speed_score, split_batch
from memplan.setup import Setup, generation_steps, needs_reference_model

@dataclass(frozen=True, slots=True)
class Remedy:
    """One change (in a combination: one step, with the cumulative setup and peak). saved_bytes < 0: it needs more.
    setup, need_bytes and fits are None for advice memplan cannot estimate (the allocator setting)."""

    name: str
    description: str
    setup: Setup | None
    need_bytes: int | None
    saved_bytes: int
    fits: bool | None
    cost: str
    size: int
    order: int = 0  # position in REMEDIES
    slowdown: float = 0.0  # 1 - relative throughput after / before (candidates.speed_score); ranks size-1 knobs

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "size": self.size, "cost": self.cost,
                "fits": self.fits, "saved_bytes": self.saved_bytes, "need_bytes": self.need_bytes,
                "setup": self.setup.to_dict() if self.setup else None}


class RemedyContext:
    """What the remedies need: the model, the budget, a memoised estimator and the GPU's bf16 support."""

    def __init__(self, spec, budget: int, estimator: Callable, bf16: bool):
        self.spec, self.budget, self.estimator, self.bf16 = spec, budget, estimator, bf16
        self.half = "bf16" if bf16 else "fp16"
        self._cache: dict = {}

    def est(self, s: Setup):
        if s not in self._cache:
            self._cache[s] = self.estimator(self.spec, s)
        return self._cache[s]

    def total(self, s: Setup) -> int:
        """What `s` needs from the GPU (memplan.planner.budget.need_bytes)."""
        return need_bytes(self.est(s))

    def fits(self, s: Setup) -> bool:
        try:
            return fits(self.est(s), self.budget)
        except MemplanError:
            return False

    def speed(self, s: Setup) -> float:
        """The planner's relative throughput of `s` (never reported: it only orders remedies)."""
        frac = 0.0
        if s.technique in ("full", "freeze"):
            frac = min(1.0, getattr(self.est(s), "params_trainable", 0) / max(1, self.spec.numel_total))
        tokens = s.seq_len + ((s.target_len or s.seq_len) if self.spec.arch.kind == "seq2seq" else 0)
        return speed_score(s, frac, tokens)


#: (name, size) by size, each size's remedies by increasing speed/quality cost; _change says what each one does
REMEDIES: tuple[tuple[str, int], ...] = (
    ("sdpa", 1), ("liger", 1), ("precompute-ref", 1), ("padding-free", 1), ("largest-micro-batch", 1),
    ("halve-batch", 1), ("grad-ckpt", 1), ("mixed-precision", 2), ("adamw-8bit", 2), ("paged-adamw-8bit", 2),
    ("plain-lora", 2), ("fewer-lora-targets", 2), ("smaller-lora-rank", 2), ("smaller-vllm-fraction", 2),
    ("fewer-steps-per-generation", 2), ("activation-offloading", 2), ("16-bit-weights", 2), ("adafactor", 2),
    ("lora", 3), ("freeze", 3), ("qlora", 4),
    ("shorter-completions", 5), ("shorter-sequences", 5),
)
_DYNAMIC = {"largest-micro-batch", "shorter-sequences"}  # sized against the budget: applied last when combined
_ADAMW = ("adamw", "adamw-fused")


def _trl_change(name: str, s: Setup) -> tuple[Setup, str, str] | None:
    """The remedies of TRL's trainers (Setup.trainer): None where `name` is not one, or does not apply. Fewer
    generations per prompt is none: GRPO's per_device_train_batch_size counts completions, so the number per prompt
    changes no memory (halve-batch keeps the generation batch, batch_size x accumulation, too)."""
    if name == "precompute-ref" and s.trainer == "dpo" and not s.precompute_ref_log_probs:
        return (replace(s, precompute_ref_log_probs=True), "precompute the reference log-probs "
                "(precompute_ref_log_probs=True)" + (": no second model" if needs_reference_model(s) else ""),
                "none for quality (the same loss); one reference pass over the data before training")
    if name == "padding-free" and s.trainer == "sft" and not (s.packing or s.padding_free):
        return (replace(s, packing=True, padded=False), "packing (packing=True: BFD, padding-free rows)",
                "none expected: the same tokens without padding (TRL recommends flash attention for it)")
    if name == "smaller-vllm-fraction" and s.trainer == "grpo" and s.use_vllm and s.vllm_mode == "colocate" \
            and s.vllm_gpu_memory_utilization > 0.15:
        u = round(s.vllm_gpu_memory_utilization - 0.1, 2)
        return (replace(s, vllm_gpu_memory_utilization=u), f"vllm_gpu_memory_utilization={u} (colocated vLLM takes "
                f"{u:.0%} of the card instead of {s.vllm_gpu_memory_utilization:.0%})",
                "speed: fewer KV-cache blocks for vLLM, so fewer completions generated at once")
    if name == "fewer-steps-per-generation" and s.trainer == "grpo" and generation_steps(s) > 1:
        k = generation_steps(s) // 2
        return (replace(s, steps_per_generation=k), f"steps_per_generation={k}: generate {s.batch_size * k} "
                f"completions at a time instead of {s.batch_size * generation_steps(s)}",
                "speed: more, smaller generation rounds; below gradient_accumulation_steps each runs with the "
                "accumulated gradients alive")
    if name == "activation-offloading" and s.trainer in ("sft", "dpo") and s.grad_ckpt \
            and not s.activation_offloading:
        return (replace(s, activation_offloading=True), "activation_offloading=True (the checkpointed blocks' inputs "
                "in pinned host memory)", "speed: a copy to the host and back per block, overlapped on a second "
                "stream; needs host RAM for the inputs")
    if name == "shorter-completions" and s.trainer == "grpo" and s.max_completion_length > 16:
        n = s.max_completion_length // 2
        return (replace(s, max_completion_length=n), f"max_completion_length={n} instead of "
                f"{s.max_completion_length}", f"changes the task: completions cut at {n} tokens")
    return None


def _change(name: str, s: Setup, c: RemedyContext) -> tuple[Setup, str, str] | None:
    """Remedy `name` applied to `s`: (changed Setup, description, speed/quality cost), None where it does not apply.
    Raises SetupError for an invalid combination."""
    lora, half, arch = s.technique in ("lora", "qlora"), c.half, c.spec.arch
    if name == "sdpa" and (s.attn_impl or default_attn_impl(c.spec)) == "eager" and sdpa_supported(c.spec):
        return replace(s, attn_impl="sdpa"), "sdpa attention instead of eager", "none: same math, usually faster"
    if (name == "liger" and not s.use_liger_kernel and s.mode == "train" and arch.kind == "causal"
            and arch.model_type in LIGER_ESTIMATED and s.trainer == "hf"):  # TRL keeps its own fused head
        return (replace(s, use_liger_kernel=True), "Liger Kernel (use_liger_kernel=True): fused linear "
                "cross-entropy without logits, leaner RMSNorm and MLP saves",
                "none for quality (same math); needs `pip install liger-kernel` and a CUDA GPU; usually faster")
    trl = _trl_change(name, s)
    if trl is not None:
        return trl
    if name == "largest-micro-batch" and s.batch_size > 1 and c.total(s) > c.budget:
        probe = replace(s, grad_accum=max(2, s.grad_accum))  # accumulating keeps the gradients between micro-steps
        b = max_batch_size(c.spec, probe, c.budget, lambda _spec, x: c.est(x), s.batch_size - 1)
        micro, accum = split_batch(s.batch_size * s.grad_accum, b) if b else (0, 0)
        return None if not b else (replace(s, batch_size=micro, grad_accum=accum),
                                   f"micro-batch {micro} x {accum} accumulation steps (the largest that fits)",
                                   f"effective batch {micro * accum}; more, smaller steps (lower throughput)")
    if name == "halve-batch" and s.batch_size > 1:
        b, a = s.batch_size // 2, s.grad_accum * 2
        return (replace(s, batch_size=b, grad_accum=a), f"halve the micro-batch: {b} x {a} accumulation steps",
                f"effective batch {b * a}; more, smaller steps (a little slower)")
    if name == "grad-ckpt" and not s.grad_ckpt:
        return (replace(s, grad_ckpt=True), "gradient checkpointing",
                "~20-30% slower steps (one extra forward pass in backward)")
    if name == "mixed-precision" and s.precision == "fp32" and not lora:
        return (replace(s, precision=f"{half}-mixed"), f"{half} mixed precision (autocast)",
                "none for quality (fp32 master weights); faster on tensor cores")
    if name == "adamw-8bit" and s.optimizer in _ADAMW:
        return (replace(s, optimizer="adamw-8bit"), "8-bit AdamW (bitsandbytes)",
                "quality: matches 32-bit AdamW in the 8-bit optimizers paper (arXiv:2110.02861)")
    if name == "paged-adamw-8bit" and s.optimizer in _ADAMW + ("adamw-8bit",):
        return (replace(s, optimizer="paged-adamw-8bit"), "paged 8-bit AdamW (bitsandbytes)",
                "as 8-bit AdamW; state pages to CPU memory under pressure (slow steps when it does)")
    if name == "plain-lora" and lora and s.use_dora:
        return (replace(s, use_dora=False), "plain LoRA instead of DoRA (use_dora=False)",
                "quality: DoRA's magnitude/direction split, a small gain over LoRA at the same rank in its paper "
                "(arXiv:2402.09353); each adapted layer then saves two fewer [tokens, out] tensors and no longer "
                "rebuilds its weight norm")
    if name == "fewer-lora-targets" and lora and s.lora_targets is not None and arch.lora_default_targets:
        default = ", ".join(arch.lora_default_targets)
        return (replace(s, lora_targets=None), f"LoRA on peft's default targets ({default})",
                "quality: fewer adapted modules (QLoRA paper: how many layers get adapters matters most)")
    if name == "smaller-lora-rank" and lora and s.lora_r > 4:
        return (replace(s, lora_r=s.lora_r // 2, lora_alpha=max(1, s.lora_alpha // 2)),
                f"LoRA rank {s.lora_r // 2} instead of {s.lora_r}",
                "quality: a smaller adapter (rank matters little with all-linear targets, QLoRA paper)")
    if name == "16-bit-weights" and s.precision not in ("bf16", "fp16") and (lora or c.bf16):  # no pure-fp16 full
        p = half if lora else "bf16"
        return replace(s, precision=p), f"{p} weights (model.to({p}))", (
            "none expected: a frozen 16-bit base, the usual LoRA setup" if lora else
            "quality: pure bf16 weights round away small updates (no fp32 master copy)")
    if name == "adafactor" and s.optimizer not in ("adafactor", "sgd"):
        return (replace(s, optimizer="adafactor"), "Adafactor instead of AdamW",
                "quality: factored second moment, usually a little below AdamW; retune the learning rate")
    if name == "lora" and not lora:
        p = s.precision if s.precision in ("bf16", "fp16") else half
        reference = " (the reference: the base with the adapter disabled, no second model)" if needs_reference_model(
            s) else ""
        return (replace(s, technique="lora", precision=p, trainable=None),
                f"LoRA r={s.lora_r} (peft's default targets) on a {p} base{reference}",
                "quality: adapters only, usually close to full fine-tuning on instruction data (arXiv:2106.09685)")
    if name == "freeze" and s.technique == "full":
        return (replace(s, technique="freeze"), "freeze all but the last block",
                "quality: only the last block adapts (the weakest adaptation)")
    if name == "qlora" and s.technique != "qlora":
        return (replace(s, technique="qlora", quant="nf4", double_quant=True, precision=half, trainable=None),
                f"QLoRA (4-bit NF4 base, double quant, {half} compute, LoRA r={s.lora_r})",
                "quality: 4-bit base, on par with 16-bit LoRA in the QLoRA paper (arXiv:2305.14314); slower steps")
    if name == "shorter-sequences" and s.seq_len > 1 and c.total(s) > c.budget:
        n = largest_fitting(lambda n: c.fits(replace(s, seq_len=n)), s.seq_len - 1)
        n = (n - n % 8 if n >= 64 else n) or s.seq_len // 2
        return (replace(s, seq_len=n), f"shorter sequences: {n} tokens instead of {s.seq_len}",
                f"changes the data: samples truncated to {n} tokens (lost context)")
    return None


def rank_key(r: Remedy) -> tuple:
    """Single remedies: size; then the smaller slowdown among size-1 knobs (they keep the training math) or the
    REMEDIES order (increasing quality cost) among larger changes; then the lower new need."""
    return (r.size, round(r.slowdown, 3) if r.size == 1 else 0.0, r.order, r.need_bytes or 0)


def apply_remedy(i: int, s: Setup, before: int, c: RemedyContext) -> Remedy | None:
    """REMEDIES[i] applied to `s` (which needs `before`), estimated; None when it does not apply."""
    name, size = REMEDIES[i]
    try:
        out = _change(name, s, c)
        if out is None or out[0] == s:
            return None
        total = c.total(out[0])
        slowdown = 1 - c.speed(out[0]) / max(c.speed(s), 1e-12)
    except MemplanError:  # an invalid combination (SetupError) or a model that cannot do it (no sdpa)
        return None
    return Remedy(name, out[1], out[0], total, before - total, total <= c.budget, out[2], size, i, slowdown)


def chain(base: Setup, before: int, indices, c: RemedyContext) -> list[Remedy]:
    """Apply remedies, largest change first and the budget-sized ones last; each step carries the cumulative setup
    and peak. A remedy that no longer applies (LoRA after QLoRA) drops out."""
    steps, s = [], base
    for i in sorted(set(indices), key=lambda j: (REMEDIES[j][0] in _DYNAMIC, -REMEDIES[j][1], j)):
        r = apply_remedy(i, s, before, c)
        if r is not None:
            steps.append(r)
            s, before = r.setup, r.need_bytes
    return steps


def _combo_key(steps: list[Remedy], base: Setup, c: RemedyContext) -> tuple:
    """Smaller is better: the sizes, largest first (a smaller biggest change, then fewer and smaller others), then
    the smaller slowdown of the final setup, then the REMEDIES order."""
    sizes = tuple(sorted((r.size for r in steps), reverse=True))
    slowdown = 1 - c.speed(steps[-1].setup) / max(c.speed(base), 1e-12)
    return (sizes, round(slowdown, 3), tuple(sorted(r.order for r in steps)))


def combine(base: Setup, before: int, c: RemedyContext, max_size: int = 5) -> tuple[Remedy, ...]:
    """Remedies of at most `max_size` combined until the setup fits (module docstring): greedy, then improved one
    swap or removal at a time while a combination with a smaller _combo_key still fits. Not fitting: the greedy
    chain, for its peak."""
    allowed = [i for i, (_, size) in enumerate(REMEDIES) if size <= max_size]
    chosen, s, total = [], base, before
    while total > c.budget:
        options = [r for i in allowed if i not in chosen
                   for r in [apply_remedy(i, s, total, c)] if r is not None and r.saved_bytes > 0]
        if not options:
            break
        fitting = [r for r in options if r.fits]
        pick = min(fitting, key=rank_key) if fitting else min(options, key=lambda r: (r.size, -r.saved_bytes))
        chosen.append(pick.order)
        s, total = pick.setup, pick.need_bytes
    best = chain(base, before, chosen, c)
    if not best or not best[-1].fits:
        return tuple(best)
    key, improved = _combo_key(best, base, c), True
    while improved:
        improved = False
        now = [r.order for r in best]
        trials = [[j for j in now if j != i] for i in now]
        trials += [[k if k != i else j for k in now] for i in now for j in allowed if j not in now]
        for trial in trials:
            steps = chain(base, before, trial, c) if trial else []
            if steps and steps[-1].fits and _combo_key(steps, base, c) < key:
                best, key, improved = steps, _combo_key(steps, base, c), True
                break
    return tuple(best)
