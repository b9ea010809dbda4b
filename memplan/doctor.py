"""memplan doctor: a training setup that does not fit (or barely fits) a GPU, and the smallest changes that fix it.

Ranking rule for single remedies that make the setup fit (rank_key; smaller is better):
  1. size, how big a change it is: 1 a runtime knob that keeps the training math (sdpa attention, a smaller
     micro-batch with more gradient accumulation - same effective batch -, gradient checkpointing); 2 optimizer or
     precision (mixed precision, 8-bit / paged 8-bit AdamW, fewer LoRA targets, smaller LoRA rank, 16-bit weights,
     Adafactor); 3 technique (LoRA on a 16-bit base, freezing all but the last block); 4 QLoRA (a 4-bit base);
     5 shorter sequences (changes the data: samples are truncated).
  2. cost: among size-1 knobs the smaller slowdown by the planner's relative throughput (search.speed_score: a
     recomputed forward, or micro-batches below ~4096 tokens); among larger changes the REMEDIES order, which lists
     each size's remedies by increasing quality cost.
  3. the lower new need (the larger margin).
Remedies that do not fit follow, most memory saved first. When none fits alone, remedies are combined (combine):
greedily - while it does not fit, add the best-ranked remedy that makes it fit, else the one saving most among the
smallest sizes - then improved one removal or swap at a time while a smaller combination still fits (smaller: the
largest change first, then fewer and smaller other changes, then the faster result).
An OOM message (parse_oom_message) gives the card's real capacity and what the run held when it failed.
"Fits" is the test fit and plan use (memplan.budget): what the setup needs within the GPU memory less the headroom.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import click

from memplan.budget import DEFAULT_HEADROOM, budget_bytes, need_bytes
from memplan.cli_common import given_setup_fields, handle_errors, headroom_option, setup_options
from memplan.errors import BadInput, MemplanError
from memplan.fit import largest_fitting, max_batch_size
from memplan.search import speed_score, split_batch
from memplan.setup import Setup
from memplan.units import GiB, KiB, MiB, fmt_gib

BARELY = 0.05  # a fitting setup with less than this fraction of the budget spare "barely fits"
FRAGMENTED = 0.10  # reserved-but-unallocated above this fraction of PyTorch's reserved memory: fragmentation

# ------------------------------------------------------------------------------------------------ OOM messages

_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}
_SIZE = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB)\b"
_FIELDS = {  # field -> patterns: the current message (torch >= 2.1) first, then the older "(GPU 0; ...)" form
    "tried_to_allocate_bytes": (r"Tried to allocate " + _SIZE,),
    "total_capacity_bytes": (r"total capac\w* of " + _SIZE, _SIZE + r" total capac"),
    "free_bytes": (r"of which " + _SIZE + r" is free", _SIZE + r" free\b"),
    "allocated_by_pytorch_bytes": (_SIZE + r" is allocated by PyTorch", _SIZE + r" already allocated"),
    "reserved_unallocated_bytes": (_SIZE + r" is reserved by PyTorch but unallocated",),
    "process_in_use_bytes": (r"this process has " + _SIZE + r" memory in use",),
}


@dataclass(frozen=True, slots=True)
class OomInfo:
    """The numbers of a PyTorch CUDA out-of-memory message, in bytes (None where the message has none)."""

    tried_to_allocate_bytes: int | None = None
    total_capacity_bytes: int | None = None
    free_bytes: int | None = None
    allocated_by_pytorch_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_in_use_bytes: int | None = None
    gpu_index: int | None = None
    other_processes_bytes: int | None = None  # "Process N has X memory in use" lines (other processes)

    @property
    def reserved_by_pytorch_bytes(self) -> int | None:
        if self.allocated_by_pytorch_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_by_pytorch_bytes + self.reserved_unallocated_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bytes(number: str, unit: str) -> int:
    return int(round(float(number.replace(",", "")) * _UNITS[unit.lower()]))


def parse_oom_message(text: str) -> OomInfo:
    """Read a pasted `torch.OutOfMemoryError` (current or pre-2.1 wording, wrapped lines allowed). Raises BadInput
    when the text is not one."""
    flat = " ".join(str(text).split())
    if not re.search(r"out of memory", flat, re.IGNORECASE) or not re.search(r"Tried to allocate " + _SIZE, flat):
        raise BadInput("not a PyTorch out-of-memory message: expected text like 'CUDA out of memory. Tried to "
                       "allocate 20.00 MiB ...' (paste the whole torch.OutOfMemoryError line)")
    found: dict = {}
    for name, patterns in _FIELDS.items():
        for p in patterns:
            m = re.search(p, flat)
            if m:
                found[name] = _bytes(m.group(1), m.group(2))
                break
    old_reserved = re.search(_SIZE + r" reserved in total by PyTorch", flat)
    if old_reserved and "allocated_by_pytorch_bytes" in found:
        reserved = _bytes(*old_reserved.groups())
        found["reserved_unallocated_bytes"] = max(0, reserved - found["allocated_by_pytorch_bytes"])
    gpu = re.search(r"\bGPU (\d+)", flat)
    others = [_bytes(n, u) for n, u in re.findall(r"Process \d+ has " + _SIZE + r" memory in use", flat)]
    return OomInfo(gpu_index=int(gpu.group(1)) if gpu else None,
                   other_processes_bytes=sum(others) if others else None, **found)


# ------------------------------------------------------------------------------------------------ remedies

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
    slowdown: float = 0.0  # 1 - relative throughput after / before (search.speed_score); ranks size-1 knobs

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "size": self.size, "cost": self.cost,
                "fits": self.fits, "saved_bytes": self.saved_bytes, "need_bytes": self.need_bytes,
                "setup": self.setup.to_dict() if self.setup else None}


class _Ctx:
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
        """What `s` needs from the GPU (memplan.budget.need_bytes)."""
        return need_bytes(self.est(s))

    def fits(self, s: Setup) -> bool:
        try:
            return self.total(s) <= self.budget
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
    ("sdpa", 1), ("largest-micro-batch", 1), ("halve-batch", 1), ("grad-ckpt", 1), ("mixed-precision", 2),
    ("adamw-8bit", 2), ("paged-adamw-8bit", 2), ("fewer-lora-targets", 2), ("smaller-lora-rank", 2),
    ("16-bit-weights", 2), ("adafactor", 2), ("lora", 3), ("freeze", 3), ("qlora", 4), ("shorter-sequences", 5),
)
_DYNAMIC = {"largest-micro-batch", "shorter-sequences"}  # sized against the budget: applied last when combined
_ADAMW = ("adamw", "adamw-fused")


def _change(name: str, s: Setup, c: _Ctx) -> tuple[Setup, str, str] | None:
    """Remedy `name` applied to `s`: (changed Setup, description, speed/quality cost), None where it does not apply.
    Raises SetupError for an invalid combination."""
    lora, half, arch = s.technique in ("lora", "qlora"), c.half, c.spec.arch
    if name == "sdpa" and (s.attn_impl or arch.default_attn_impl) == "eager" and arch.supports_sdpa:
        return replace(s, attn_impl="sdpa"), "sdpa attention instead of eager", "none: same math, usually faster"
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
        return (replace(s, technique="lora", precision=p, trainable=None),
                f"LoRA r={s.lora_r} (peft's default targets) on a {p} base",
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


def _apply(i: int, s: Setup, before: int, c: _Ctx) -> Remedy | None:
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


def _chain(base: Setup, before: int, indices, c: _Ctx) -> list[Remedy]:
    """Apply remedies, largest change first and the budget-sized ones last; each step carries the cumulative setup
    and peak. A remedy that no longer applies (LoRA after QLoRA) drops out."""
    steps, s = [], base
    for i in sorted(set(indices), key=lambda j: (REMEDIES[j][0] in _DYNAMIC, -REMEDIES[j][1], j)):
        r = _apply(i, s, before, c)
        if r is not None:
            steps.append(r)
            s, before = r.setup, r.need_bytes
    return steps


def _combo_key(steps: list[Remedy], base: Setup, c: _Ctx) -> tuple:
    """Smaller is better: the sizes, largest first (a smaller biggest change, then fewer and smaller others), then
    the smaller slowdown of the final setup, then the REMEDIES order."""
    sizes = tuple(sorted((r.size for r in steps), reverse=True))
    slowdown = 1 - c.speed(steps[-1].setup) / max(c.speed(base), 1e-12)
    return (sizes, round(slowdown, 3), tuple(sorted(r.order for r in steps)))


def combine(base: Setup, before: int, c: _Ctx, max_size: int = 5) -> tuple[Remedy, ...]:
    """Remedies of at most `max_size` combined until the setup fits (module docstring): greedy, then improved one
    swap or removal at a time while a combination with a smaller _combo_key still fits. Not fitting: the greedy
    chain, for its peak."""
    allowed = [i for i, (_, size) in enumerate(REMEDIES) if size <= max_size]
    chosen, s, total = [], base, before
    while total > c.budget:
        options = [r for i in allowed if i not in chosen
                   for r in [_apply(i, s, total, c)] if r is not None and r.saved_bytes > 0]
        if not options:
            break
        fitting = [r for r in options if r.fits]
        pick = min(fitting, key=rank_key) if fitting else min(options, key=lambda r: (r.size, -r.saved_bytes))
        chosen.append(pick.order)
        s, total = pick.setup, pick.need_bytes
    best = _chain(base, before, chosen, c)
    if not best or not best[-1].fits:
        return tuple(best)
    key, improved = _combo_key(best, base, c), True
    while improved:
        improved = False
        now = [r.order for r in best]
        trials = [[j for j in now if j != i] for i in now]
        trials += [[k if k != i else j for k in now] for i in now for j in allowed if j not in now]
        for trial in trials:
            steps = _chain(base, before, trial, c) if trial else []
            if steps and steps[-1].fits and _combo_key(steps, base, c) < key:
                best, key, improved = steps, _combo_key(steps, base, c), True
                break
    return tuple(best)


# ------------------------------------------------------------------------------------------------ diagnosis

@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The setup's estimate against the budget, the ranked single remedies and (none fitting) a combination."""

    model: str
    setup: Setup
    budget_bytes: int
    estimate: object  # Estimate
    remedies: tuple[Remedy, ...] = ()
    combination: tuple[Remedy, ...] = ()
    oom: OomInfo | None = None
    notes: tuple[str, ...] = ()
    budget_source: str = ""

    @property
    def need_bytes(self) -> int:
        return need_bytes(self.estimate)

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.budget_bytes

    @property
    def margin_bytes(self) -> int:
        return self.budget_bytes - self.need_bytes

    @property
    def barely_fits(self) -> bool:
        return self.fits and self.margin_bytes < BARELY * self.budget_bytes

    @property
    def best(self) -> Remedy | None:
        """The single smallest change that fits (the first ranked remedy, which fit ones lead)."""
        return next((r for r in self.remedies if r.fits), None)

    @property
    def fix(self) -> tuple[Remedy, ...]:
        """The smallest change that makes it fit: a fitting combination of smaller changes than the best single
        remedy, else that remedy; () when nothing fits (or nothing needs to)."""
        if self.combination and self.combination[-1].fits:
            return self.combination
        return (self.best,) if self.best and not self.fits else ()

    @property
    def resolved(self) -> bool:
        return self.fits or bool(self.fix)

    @property
    def exit_code(self) -> int:
        return 0 if self.resolved else 1

    @property
    def first_line(self) -> str:
        need, budget = fmt_gib(self.need_bytes), fmt_gib(self.budget_bytes)
        if self.fits:
            spare = f"{fmt_gib(self.margin_bytes)} ({self.margin_bytes / self.budget_bytes:.1%}) spare"
            tip = (f"; for more margin: {self.best.description} -> {fmt_gib(self.best.need_bytes)}"
                   if self.best else "")
            if self.oom:
                return f"Estimated to fit ({need} of {budget}, {spare}), but the run ran out of memory{tip}."
            return f"Barely fits: {need} of {budget}, only {spare}{tip}." if self.barely_fits else \
                f"Fits: {need} of {budget}, {spare}."
        if self.fix:
            last = self.fix[-1]
            if len(self.fix) == 1:
                return (f"Smallest change that fits: {last.description} -> {fmt_gib(last.need_bytes)} "
                        f"of {budget} (saves {fmt_gib(last.saved_bytes)}; {last.cost}).")
            why = f"smaller changes than the best single one, {self.best.description}" if self.best else \
                "no single change fits"
            return (f"Smallest change that fits: {' + '.join(r.description for r in self.fix)} -> "
                    f"{fmt_gib(last.need_bytes)} of {budget} ({why}).")
        least = fmt_gib(self.combination[-1].need_bytes) if self.combination else need
        return (f"Nothing fits: {need} > {budget}, and {least} even with every remedy; use a larger GPU or "
                "shard across GPUs (FSDP / DeepSpeed ZeRO-3).")

    def to_dict(self) -> dict:
        return {"model": self.model, "setup": self.setup.to_dict(), "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source, "need_bytes": self.need_bytes,
                "fits": self.fits, "barely_fits": self.barely_fits, "margin_bytes": self.margin_bytes,
                "resolved": self.resolved, "first_line": self.first_line,
                "best": self.best.to_dict() if self.best else None, "fix": [r.to_dict() for r in self.fix],
                "remedies": [r.to_dict() for r in self.remedies],
                "combination": [r.to_dict() for r in self.combination],
                "oom": self.oom.to_dict() if self.oom else None, "notes": list(self.notes)}


def _oom_findings(oom: OomInfo, estimated: int, budget: int) -> tuple[list[str], list[Remedy]]:
    """Measured vs estimated, other processes on the card, and the allocator remedy when memory is fragmented."""
    notes, extra = [], []
    held = oom.process_in_use_bytes or oom.reserved_by_pytorch_bytes
    if held is not None:
        need = held + (oom.tried_to_allocate_bytes or 0)
        verdict = ("the estimate is below what the run needed: check that the flags match the run (batch, seq_len, "
                   "precision, attention, optimizer); the savings below are estimates" if estimated < need else
                   "consistent: the run failed on its way to the estimated peak" if estimated > budget else
                   "the estimate fits, yet the run failed: fragmentation, other processes or memory memplan does "
                   "not model")
        who = "the process held" if oom.process_in_use_bytes else "PyTorch had reserved"
        notes.append(f"measured: {who} {fmt_gib(held)} and asked for {fmt_gib(oom.tried_to_allocate_bytes or 0)} "
                     f"more, so the run needed at least {fmt_gib(need)}; estimated need {fmt_gib(estimated)} "
                     f"({verdict})")
    if oom.other_processes_bytes:
        notes.append(f"other processes hold {fmt_gib(oom.other_processes_bytes)} on this GPU: that memory is not "
                     "available to this run")
    if oom.total_capacity_bytes and abs(oom.total_capacity_bytes - budget) > BARELY * budget:
        notes.append(f"the OOM message reports {fmt_gib(oom.total_capacity_bytes)} total capacity; the budget "
                     f"used is {fmt_gib(budget)}")
    reserved, loose = oom.reserved_by_pytorch_bytes, oom.reserved_unallocated_bytes
    if reserved and loose and loose > FRAGMENTED * reserved:
        extra.append(Remedy("expandable-segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                            None, None, loose, None, f"fragmentation: {fmt_gib(loose)} reserved by PyTorch but "
                            "unallocated; no speed cost; memplan cannot estimate its effect (no estimate)", 1, -1))
    return notes, extra


def diagnose(spec, setup: Setup, budget_bytes: int, estimator: Callable | None = None, *, bf16: bool = True,
             oom: OomInfo | None = None, budget_source: str = "") -> Diagnosis:
    """Estimate `setup` on `spec` against `budget_bytes` and rank the remedies (module docstring). `bf16`: the GPU
    runs bf16 (else remedies use fp16). `oom`: a parsed OOM message to compare with. Training setups only."""
    if setup.mode != "train":
        raise BadInput("doctor diagnoses training setups; for inference use `memplan fit` or "
                       "`memplan estimate --mode infer`")
    if estimator is None:
        from memplan.estimate import estimate as estimator
    c = _Ctx(spec, int(budget_bytes), estimator, bf16)
    est = c.est(setup)
    before = need_bytes(est)
    notes, advice = _oom_findings(oom, before, c.budget) if oom else ([], [])
    done = partial(Diagnosis, spec.model_id, setup, c.budget, est, oom=oom, notes=tuple(notes),
                   budget_source=budget_source)
    if before < c.budget * (1 - BARELY) and not oom:  # fits with room to spare: nothing to change
        return done()
    singles = [r for i in range(len(REMEDIES)) for r in [_apply(i, setup, before, c)] if r is not None]
    if before <= c.budget:  # barely fits (or an OOM says the run did not): what buys margin, smallest change first
        return done(tuple(sorted((r for r in singles if r.saved_bytes > 0), key=rank_key) + advice))
    fitting = sorted((r for r in singles if r.fits), key=rank_key)
    rest = sorted((r for r in singles if not r.fits), key=lambda r: (-r.saved_bytes, r.order))
    # a combination of strictly smaller changes beats the best single one (two knobs before truncating the data)
    limit = fitting[0].size - 1 if fitting else REMEDIES[-1][1]
    combination = combine(setup, before, c, limit) if limit else ()
    if fitting and not (combination and combination[-1].fits):
        combination = ()
    return done(tuple(fitting + advice + rest), combination)


# ------------------------------------------------------------------------------------------------ rendering, CLI

def print_diagnosis(diag: Diagnosis, console=None) -> None:
    """First line (the smallest fix), the ranked remedies, the combination and the notes, as rich tables."""
    from rich.console import Console
    from rich.table import Table

    from memplan.explain import describe

    console = console or Console()
    colour = "green" if diag.fits and not diag.barely_fits else ("yellow" if diag.resolved else "red")
    console.print(f"[bold {colour}]{diag.first_line}[/]", highlight=False)
    console.print(f"{diag.model} · {describe(diag.setup)} · seq {diag.setup.seq_len}: "
                  f"needs {fmt_gib(diag.need_bytes)} (peak allocated + largest tensor + memory outside the allocator) "
                  f"of the budget {fmt_gib(diag.budget_bytes)}"
                  + (f" ({diag.budget_source})" if diag.budget_source else ""), highlight=False)
    if diag.remedies:
        t = Table(title="remedies, smallest change first (size 1 knob ... 5 data)", title_justify="left")
        for col, just in (("#", "right"), ("change · its cost", "left"), ("size", "right"), ("saves GiB", "right"),
                          ("new need GiB", "right"), ("fits", "center")):
            t.add_column(col, justify=just)
        for n, r in enumerate(diag.remedies, 1):
            peak = "n/a" if r.need_bytes is None else f"{r.need_bytes / GiB:,.2f}"
            fits = "?" if r.fits is None else ("[green]yes[/]" if r.fits else "[red]no[/]")
            saves = f"{'up to ' if r.fits is None else ''}{r.saved_bytes / GiB:,.2f}"
            t.add_row(str(n), f"{r.description}\n[dim]{r.cost}[/]", str(r.size), saves, peak, fits)
        console.print(t)
    if diag.combination:
        t = Table(title="combined (cumulative, in order of application)", title_justify="left")
        for col, just in (("step · its cost", "left"), ("saves GiB", "right"), ("needs GiB", "right"),
                          ("fits", "center")):
            t.add_column(col, justify=just)
        for r in diag.combination:
            t.add_row(f"{r.description}\n[dim]{r.cost}[/]", f"{r.saved_bytes / GiB:,.2f}",
                      f"{r.need_bytes / GiB:,.2f}", "[green]yes[/]" if r.fits else "[red]no[/]")
        console.print(t)
        console.print(f"combined setup: {describe(diag.combination[-1].setup)}", highlight=False)
    for note in diag.notes:
        console.print(f"note: {note}", highlight=False)


def setup_from_plan(doc: dict, given: dict) -> Setup:
    """The plan file's Setup with the flags in `given` overriding it (technique-specific fields a new technique
    cannot take are dropped)."""
    names = {f.name for f in dataclasses.fields(Setup)}
    base = {k: v for k, v in ((doc.get("memplan") or {}).get("setup") or {}).items() if k in names}
    tech = given.get("technique")
    if tech and tech != base.get("technique"):
        drop = set() if tech in ("lora", "qlora") else {"lora_targets"}
        drop |= set() if tech == "freeze" else {"trainable"}
        drop |= set() if tech == "qlora" else {"quant", "double_quant"}  # qlora picks its own 4-bit base
        base = {k: v for k, v in base.items() if k not in drop - set(given)}
    return Setup(**{**base, **given})


def _gpu_memory(gpu_name, memory, oom: OomInfo | None, doc: dict | None) -> tuple[int, str, bool]:
    """(GPU memory bytes, where it came from, bf16): --gpu/--memory, else the OOM message, else the plan's GPU."""
    from memplan.gpus import find_gpu, resolve_gpu

    if not (gpu_name or memory) and oom and oom.total_capacity_bytes:
        return oom.total_capacity_bytes, "total capacity in the OOM message", True
    if not (gpu_name or memory) and doc:
        m = doc.get("memplan") or {}
        try:
            g = find_gpu(str(m.get("gpu")))
            return g.memory_bytes, f"{g.name}, from the plan", g.bf16
        except BadInput:
            if m.get("gpu_memory_gib"):
                return int(float(m["gpu_memory_gib"]) * GiB), f"{m.get('gpu')}, from the plan", True
    g = resolve_gpu(gpu_name, memory)
    return g.memory_bytes, g.name, g.bf16


def run_doctor(model: str | None, gpu_name: str | None = None, memory: str | None = None, from_plan: str | None = None,
               oom_message: str | None = None, oom_file: str | None = None, given: dict | None = None,
               trust_remote_code: bool = False, headroom: float = DEFAULT_HEADROOM) -> Diagnosis:
    """The command's work: read the OOM text and the plan file, build the setup (plan fields, then `given` flags),
    pick the GPU memory and its budget (memplan.budget), diagnose. Raises BadInput for anything the user must fix."""
    from memplan.export import read_plan_document
    from memplan.models import load_spec

    if oom_message and oom_file:
        raise BadInput("pass either --oom-message or --oom-file, not both")
    if oom_file:
        try:
            with open(oom_file, encoding="utf-8", errors="replace") as f:
                oom_message = f.read()
        except OSError as e:
            raise BadInput(f"cannot read {oom_file!r}: {e.strerror}") from None
    oom = parse_oom_message(oom_message) if oom_message is not None else None
    doc = read_plan_document(from_plan) if from_plan else None
    setup = setup_from_plan(doc, given or {}) if doc else Setup(**(given or {}))
    model = model or (doc and (doc.get("model") or {}).get("id"))
    if not model:
        raise BadInput("name a MODEL (e.g. meta-llama/Llama-2-7b-hf) or a plan file with --from plan.yaml")
    gpu_bytes, source, bf16 = _gpu_memory(gpu_name, memory, oom, doc)
    return diagnose(load_spec(model, trust_remote_code=trust_remote_code), setup, budget_bytes(gpu_bytes, headroom),
                    bf16=bf16, oom=oom, budget_source=f"{source}: {fmt_gib(gpu_bytes)} less {headroom:.1%} headroom")


@click.command("doctor")
@click.argument("model", required=False)
@click.option("--gpu", "gpu_name", help='GPU name, e.g. "RTX 3060" (see `memplan gpus`)')
@click.option("--memory", help="memory budget instead of a GPU name, e.g. 12GiB")
@click.option("--from", "from_plan", type=click.Path(dir_okay=False),
              help="plan file (memplan plan -o): its model, setup and GPU; flags override them")
@click.option("--oom-message", help='a pasted "CUDA out of memory. Tried to allocate ..." error')
@click.option("--oom-file", type=click.Path(dir_okay=False), help="a file holding the OOM error output")
@headroom_option
@setup_options
@click.option("--trust-remote-code", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@handle_errors
def doctor_command(model, gpu_name, memory, from_plan, oom_message, oom_file, headroom, trust_remote_code, as_json,
                   **options):
    """Why a training setup does not fit (or barely fits) a GPU, and the smallest changes that make it fit.
    Exit 0: it fits or a change makes it fit; 1: nothing does; 2: bad input."""
    diag = run_doctor(model, gpu_name, memory, from_plan, oom_message, oom_file, given_setup_fields(options),
                      trust_remote_code, headroom)
    if as_json:
        click.echo(json.dumps(diag.to_dict(), indent=2))
    else:
        print_diagnosis(diag)
    sys.exit(diag.exit_code)
