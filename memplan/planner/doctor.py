"""memplan doctor: a training setup that does not fit (or barely fits) a GPU, and the smallest changes that fix it.

The remedies and their ranking rule: memplan.planner.remedies. A pasted OOM message (memplan.planner.oom) gives the
card's real capacity and what the run held when it failed. "Fits" is the test fit and plan use
(memplan.planner.budget): what the setup needs within the GPU memory less the headroom.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from memplan.errors import BadInput
from memplan.planner.budget import fits, need_bytes
from memplan.planner.oom import OomInfo
from memplan.planner.remedies import REMEDIES, Remedy, RemedyContext, apply_remedy, combine, rank_key
from memplan.setup import Setup
from memplan.units import fmt_gib
from memplan.estimator import breakdown

BARELY = 0.05  # a fitting setup with less than this fraction of the budget spare "barely fits"
FRAGMENTED = 0.10  # reserved-but-unallocated above this fraction of PyTorch's reserved memory: fragmentation


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
        return fits(self.estimate, self.budget_bytes)

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


def _oom_findings(oom: OomInfo, estimated: int, budget: int, memory: int) -> tuple[list[str], list[Remedy]]:
    """What a parsed OOM message says against the estimate: measured vs estimated, other processes on the card,
    a capacity unlike the GPU's, and the allocator remedy when memory is fragmented (FRAGMENTED).

    Returns:
        (notes, extra remedies)."""
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
    if oom.total_capacity_bytes and abs(oom.total_capacity_bytes - memory) > BARELY * memory:
        notes.append(f"the OOM message reports {fmt_gib(oom.total_capacity_bytes)} total capacity; the GPU memory "
                     f"used is {fmt_gib(memory)} (budget {fmt_gib(budget)})")
    reserved, loose = oom.reserved_by_pytorch_bytes, oom.reserved_unallocated_bytes
    if reserved and loose and loose > FRAGMENTED * reserved:
        extra.append(Remedy("expandable-segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                            None, None, loose, None, f"fragmentation: {fmt_gib(loose)} reserved by PyTorch but "
                            "unallocated; no speed cost; memplan cannot estimate its effect (no estimate)", 1, -1))
    return notes, extra


def diagnose(spec, setup: Setup, budget_bytes: int, estimator: Callable | None = None, *, bf16: bool = True,
             oom: OomInfo | None = None, budget_source: str = "", gpu_memory_bytes: int | None = None) -> Diagnosis:
    """Estimate `setup` on `spec` against `budget_bytes` and rank the remedies (module docstring). `bf16`: the GPU
    runs bf16 (else remedies use fp16). `oom`: a parsed OOM message to compare with; `gpu_memory_bytes`: the card the
    budget was taken from (default: the budget itself). Training setups only."""
    if setup.mode != "train":
        raise BadInput("doctor diagnoses training setups; for inference use `memplan fit` or "
                       "`memplan estimate --mode infer`")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise BadInput(f"budget_bytes must be a positive whole number of bytes, got {budget_bytes!r} "
                       "(memplan.units.parse_size reads '12GiB')")
    estimator = estimator or breakdown.estimate
    c = RemedyContext(spec, int(budget_bytes), estimator, bf16)
    est = c.est(setup)
    before = need_bytes(est)
    memory = gpu_memory_bytes or c.budget  # the card the budget was taken from (the OOM message is compared with it)
    notes, advice = _oom_findings(oom, before, c.budget, memory) if oom else ([], [])
    done = partial(Diagnosis, spec.model_id, setup, c.budget, est, oom=oom, notes=tuple(notes),
                   budget_source=budget_source)
    if before < c.budget * (1 - BARELY) and not oom:  # fits with room to spare: nothing to change
        return done()
    singles = [r for i in range(len(REMEDIES)) for r in [apply_remedy(i, setup, before, c)] if r is not None]
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


