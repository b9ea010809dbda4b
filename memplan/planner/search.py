"""plan(): the best training setup that fits a GPU, found analytically (no GPU touched, no OOM-and-retry).

The search space (docs/PLANNER.md has the rationale): technique x precision x LoRA rank x LoRA targets x
optimizer x gradient checkpointing, and for each candidate the largest micro-batch (binary search over the
estimate, which is monotone in the batch size) up to the effective batch; gradient accumulation makes up the
rest. Any Setup field can be pinned; the search fills the others.

Preferences order the candidates by a key (smaller is better):
  quality: (technique, precision, LoRA targets, optimizer, -LoRA rank), then speed
  speed:   relative throughput, then quality
  memory:  the smallest need (memplan.planner.budget) at micro-batch 1, then quality (micro-batch 1, accumulation =
           effective batch)
The candidates, the quality ranking and the speed score: memplan.planner.candidates. A candidate fits when its need is
within the budget (memplan.planner.budget, the test fit and doctor use too).
The search is best-first with an optimistic bound (each candidate's key at the largest useful micro-batch), so
it stops as soon as no unevaluated candidate can beat the best one found.

Pure: the estimator is injected (tests pass a fake).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from memplan.errors import BadInput, MemplanError
from memplan.planner.budget import DEFAULT_HEADROOM, REPLAY_HEADROOM, budget_bytes, fits, need_bytes, split
from memplan.planner.candidates import (RANKS, TECHNIQUE_ORDER, Pool, grpo_accum, grpo_batch_unit, quality_key,
                                        speed_score, split_batch, world_size)
from memplan.planner.explain import describe, lost_reason
from memplan.planner.types import Alternative, Candidate, Plan
from memplan.setup import Setup, value_problems
from memplan.estimator.breakdown import estimator_for
from memplan.gpus import Gpu, load_gpus, resolve_gpu
from memplan.model.catalog import load_spec
from memplan.planner.fit_table import largest_fitting, GPU_COUNTS, gpu_layout
from memplan.planner.refine import cached_replay_need, refine
from memplan.replay.affine import applies
from memplan.replay.need import NotCached
from memplan.units import fmt_gib, parse_size

PREFERENCES = ("quality", "speed", "memory")
DEFAULT_EFFECTIVE_BATCH = 32


# ---------------------------------------------------------------------------------------------------- the search

class Search:
    """One search's settings and state: the budget, the estimator (counting its calls) and the preference's key."""

    def __init__(self, spec, gpu: Gpu, seq_len: int, effective: int, prefer: str, pinned: dict,
                 estimator: Callable, budget: int, host_budget: int | None = None):
        self.spec, self.gpu, self.seq_len, self.effective = spec, gpu, seq_len, effective
        self.host_budget = host_budget
        self.headroom_bytes = gpu.memory_bytes - budget
        self.prefer, self.pinned, self.estimator, self.budget = prefer, pinned, estimator, budget
        self.evaluated = 0
        self.total_params = max(1, spec.numel_total)
        arch = spec.arch
        self.tokens = seq_len + ((pinned.get("target_len") or seq_len) if arch.kind == "seq2seq" else 0)

    def estimate(self, setup: Setup):
        self.evaluated += 1
        return self.estimator(self.spec, setup)

    def need(self, e) -> int:
        """Bytes a setup must find under the budget: Estimate.cap_need_bytes, its live peak plus a fresh block for
        its largest tensor plus the device-only memory (docs/PLANNER.md, "Budget": under a cap the caching
        allocator releases its free cache and retries, so the uncapped reserved peak is not the limit; a setup
        OOMs when the live peak and one contiguous block for the largest request pass the cap). A node's offloaded
        state beyond host_budget makes the setup not fit."""
        need = need_bytes(e)
        host = getattr(e, "host_bytes", 0)
        if host and self.host_budget is not None and host * e.setup.num_gpus > self.host_budget:  # the node's ranks
            return max(need, self.budget + 1)  # does not fit: the node's RAM cannot hold the offloaded state
        return need

    def trainable_fraction(self, setup: Setup, est) -> float:
        return min(1.0, est.params_trainable / self.total_params) if setup.technique in ("full", "freeze") else 0.0

    def key(self, fields: Setup | Mapping, frac: float, batch1_total: int = 0, batch: int | None = None,
            accum: int | None = None) -> tuple:
        """A candidate's rank (smaller is better): its Setup or, before that is built, its Pool fields; at its own
        micro-batch and accumulation unless given."""
        batch = batch or fields.batch_size  # Pool fields come with both given (optimistic_key)
        accum = accum or fields.grad_accum
        q = quality_key(fields)
        score = -round(speed_score(fields, frac, self.tokens, batch), 6)
        if self.prefer == "quality":
            return q + (score, accum)
        if self.prefer == "speed":
            return (score,) + q + (accum,)
        return (batch1_total,) + q + (score, accum)

    def optimistic_key(self, fields: Mapping) -> tuple:
        """A key no evaluation of this candidate can beat (speed at the largest useful micro-batch, full-model
        weight gradients counted only for full fine-tuning)."""
        frac = 1.0 if fields["technique"] == "full" else 0.0
        return self.key(fields, frac, 0, self.pinned.get("batch_size") or self.effective, 1)

    def accum_for(self, batch: int) -> int:
        """Accumulation steps a micro-batch implies (memory only sees whether it is > 1: gradients then persist
        across micro-steps); GRPO: the fewest at least that many whose generation batch divides into prompts."""
        return self.pinned.get("grad_accum") or self.prompts_accum(batch, max(1, math.ceil(self.effective / batch)))

    def prompts_accum(self, batch: int, accum: int = 1) -> int:
        """grpo_accum under this search's pinned fields."""
        return grpo_accum(self.pinned, batch, accum)

    def evaluate(self, setup: Setup) -> Candidate:
        """The candidate at its best micro-batch (or at batch 1 when nothing fits).

        Memory is monotone in the micro-batch at a fixed accumulation, but accumulating (any grad_accum > 1) keeps
        the gradients alive through the next micro-steps: the whole effective batch in one micro-batch can fit
        where a smaller micro-batch with accumulation does not. Both sides are searched."""
        cache: dict[tuple[int, int], object] = {}

        def est(b: int, ga: int):
            if (b, ga) not in cache:
                cache[b, ga] = self.estimate(dataclasses.replace(setup, batch_size=b, grad_accum=ga))
            return cache[b, ga]

        def fits(b: int) -> bool:
            return self.need(est(b, self.accum_for(b))) <= self.budget

        pinned_b, pinned_ga = self.pinned.get("batch_size"), self.pinned.get("grad_accum")
        unit = grpo_batch_unit(self.pinned)  # GRPO with the accumulation pinned: whole groups per micro-batch
        low_b = pinned_b or unit
        low_ga = pinned_ga or self.prompts_accum(low_b)
        smallest = est(low_b, low_ga)  # the least memory this candidate can take
        if self.need(smallest) > self.budget:
            return Candidate(dataclasses.replace(setup, batch_size=low_b, grad_accum=low_ga), smallest, False, 0, ())
        if pinned_b:
            b, ga = pinned_b, self.accum_for(pinned_b)
        elif self.prefer == "memory":
            b, ga = unit, self.accum_for(unit)
        elif pinned_ga:
            groups = largest_fitting(lambda k: fits(k * unit), max(1, math.ceil(self.effective / pinned_ga / unit)))
            b, ga = unit * (groups or 1), pinned_ga
        else:
            b, ga = split_batch(self.effective, largest_fitting(fits, self.effective - 1) or 1)
            ga = self.prompts_accum(b, ga)
            if b * ga != self.effective or not fits(b):  # try the whole batch at once (no accumulation)
                whole = self.prompts_accum(self.effective)
                if self.need(est(self.effective, whole)) <= self.budget:
                    b, ga = self.effective, whole
        e = est(b, ga)
        first = est(unit, self.accum_for(unit)) if not pinned_b else e
        chosen = dataclasses.replace(setup, batch_size=b, grad_accum=ga)
        if self.need(e) > self.budget:
            return Candidate(chosen, e, False, 0, ())
        frac = self.trainable_fraction(setup, e)
        return Candidate(chosen, e, True, b, self.key(chosen, frac, need_bytes(first)))


def plan(spec, gpu: Gpu | str | None = None, seq_len: int = 512, effective_batch: int = DEFAULT_EFFECTIVE_BATCH,
         prefer: str = "quality", headroom: float | None = None, estimator: Callable | None = None,
         alternatives: int = 4, memory: int | str | None = None, host_memory: int | str | None = None,
         replay: bool | None = None, **pinned) -> Plan:
    """Search the best training setup of `spec` that fits `gpu` with `headroom` of its usable memory spare.

    spec: a ModelSpec or anything load_spec takes (catalog id, config.json). gpu: a Gpu, a catalog name, or None
    with `memory` (a size such as "12GiB") or neither (the detected GPU). pinned: Setup fields fixed by the user
    (e.g. technique="lora", lora_r=16); pinning num_gpus (num_nodes, sharding, offload) searches sharding x
    offload on that many GPUs, and when nothing fits one GPU and none of them is pinned the plan is for the fewest
    GPUs that fit; padded defaults to True (the plan file's collator pads). host_memory: RAM per node for CPU
    offload (a size; default this machine's RAM). replay: True sets the micro-batch of a single-GPU plan by
    replaying the caching allocator over traced steps (memplan.planner.refine; seconds to minutes on the CPU the
    first time, then cached); None (the CLI's default) does so when every replay it needs is cached, else plans
    with the closed-form bound and says why in Plan.replay["closed_form"]; False: the closed-form bound. headroom:
    default DEFAULT_HEADROOM, REPLAY_HEADROOM where the replay sets the plan (memplan.planner.budget). Raises BadInput
    for a bad preference, a pin that is not a Setup field, or pins that contradict each other.
    """
    if isinstance(spec, str):
        spec = load_spec(spec)
    if not isinstance(gpu, Gpu):
        gpu = resolve_gpu(gpu, memory)
    if estimator is None:
        estimator = estimator_for(gpu)

    given_headroom = headroom
    if headroom is None:
        headroom = DEFAULT_HEADROOM if replay is False else REPLAY_HEADROOM
    problems = []
    if prefer not in PREFERENCES:
        problems.append(f"prefer={prefer!r} is not one of {', '.join(PREFERENCES)}")
    if not isinstance(effective_batch, int) or effective_batch < 1:
        problems.append(f"effective batch must be an integer >= 1, got {effective_batch!r}")
    if not 0 <= headroom < 1:
        problems.append(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    names = {f.name for f in dataclasses.fields(Setup)}
    problems += [f"{k!r} is not a Setup field" for k in pinned if k not in names]
    problems += value_problems({k: v for k, v in pinned.items() if k in names})
    if pinned.get("precision") in ("bf16", "bf16-mixed") and not gpu.bf16:
        problems.append(f"the {gpu.name} has no bf16 (compute capability below 8.0), so a plan pinned to "
                        f"--precision {pinned['precision']} could not run there: pin fp16-mixed (or fp16) instead")
    if pinned.get("mode", "train") != "train":
        problems.append("plan searches training setups; for inference use `memplan fit` or `memplan estimate "
                        "--mode infer`")
    if problems:
        raise BadInput("cannot plan:\n" + "\n".join(f"  - {p}" for p in problems))
    pinned = {k: v for k, v in pinned.items() if v is not None and k != "mode"}
    pinned.setdefault("padded", True)  # the plan file's collator pads batches (export.data_section)
    seq_len = pinned.pop("seq_len", seq_len)
    if host_memory is None:
        host_budget = host_memory_bytes()
    else:
        try:
            host_budget = host_memory if isinstance(host_memory, int) else parse_size(host_memory)
        except ValueError as e:
            raise BadInput(f"--host-memory: {e}") from None
    opts = dict(seq_len=seq_len, effective_batch=effective_batch, prefer=prefer, headroom=headroom,
                estimator=estimator, alternatives=alternatives, host_budget=host_budget)
    result = _closed_form(spec, gpu, pinned, opts)
    if replay:
        return refine(result, spec, estimator)
    if replay is None:  # the replay where it is cached, else the closed form with its own headroom
        try:
            refined = refine(result, spec, estimator, cached_replay_need)
            why = refined.replay.get("skipped")
        except NotCached:
            reach = ("at any micro-batch and on any card" if applies(result.setup) else
                     "where they probe the same micro-batches (DPO, Liger and offloaded runs are traced per "
                     "micro-batch, as are TRL's SFT and GRPO where the head scores more than 4,096 tokens)")
            cost = ("a few minutes on the CPU: GRPO's generate() is traced"
                    if result.setup.trainer == "grpo" else "seconds to a minute on the CPU")
            refined, why = None, ("the allocator replay of this setup is not cached yet; `--replay` traces it "
                                  f"once ({cost}), and later plans of it use it by default, {reach}")
        except MemplanError as e:  # a spec the tracer cannot build (no config.json behind it)
            refined, why = None, f"no allocator replay: {e}"
        if refined is not None and "replayed" in refined.replay:
            return refined
        if given_headroom is None:
            result = _closed_form(spec, gpu, pinned, dict(opts, headroom=DEFAULT_HEADROOM))
        return dataclasses.replace(result, replay={"closed_form": why} if why else {})
    return result


def _closed_form(spec, gpu: Gpu, pinned: dict, opts: dict) -> Plan:
    """The plan by the closed-form fit test: on one GPU, else (nothing fits one and no GPU count, sharding or
    offload is pinned) on the fewest GPUs that fit."""
    result = _plan_at(spec, gpu, pinned, opts)
    if not result.fits and not pinned.keys() & {"num_gpus", "num_nodes", "sharding", "offload"}:
        result = fewest_gpus(spec, gpu, pinned, result, opts)
    return result


def host_memory_bytes() -> int | None:
    """This machine's RAM (the default host budget for CPU offload: a node like the one planning), None if unknown."""
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def fewest_gpus(spec, gpu: Gpu, pinned: dict, single: Plan, opts: dict) -> Plan:
    """Nothing fits one GPU: the plan on the fewest GPUs of the card (fit.GPU_COUNTS). A count is feasible when
    one of the leanest candidates (checkpointing, the smallest LoRA rank, peft's default targets; pins kept) fits at
    micro-batch 1; per-GPU memory of a sharded setup does not grow with the count, so a bisection finds the fewest.
    Returns `single` (the one-GPU "nothing fits" answer) when even the largest count does not fit."""

    def feasible(n: int) -> bool:
        p = {**pinned, **gpu_layout(n)}
        search = _search(spec, gpu, p, opts)
        for setup in Pool(opts["seq_len"], gpu.bf16, p, keep=lambda f: _lean(f, p)).setups():
            try:
                if search.need(search.estimate(setup)) <= search.budget:
                    return True
            except MemplanError:
                continue
        return False

    counts = GPU_COUNTS[1:]
    if not feasible(counts[-1]):
        return dataclasses.replace(single, suggestions=single.suggestions + (
            f"nothing fits even {counts[-1]} x {gpu.name} with ZeRO-3/FSDP and CPU offload "
            "(within the host RAM: --host-memory)",))
    lo, hi = -1, len(counts) - 1  # counts[hi] is feasible; counts[lo] is not (or lo = -1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(counts[mid]) else (mid, hi)
    best = _plan_at(spec, gpu, {**pinned, **gpu_layout(counts[hi])}, opts)
    return dataclasses.replace(best, suggestions=(
        f"nothing fits one {gpu.name}: the fewest that fit are {counts[hi]} (pin --num-gpus to plan for another "
        "count)",))


def _lean(fields: dict, pinned: dict) -> bool:
    """One of the leanest candidates: checkpointing, peft's default targets, the smallest rank (pins kept)."""
    return (fields["grad_ckpt"] or "grad_ckpt" in pinned) \
        and (fields.get("lora_targets") is None or "lora_targets" in pinned) \
        and (fields.get("lora_r") in (None, min(RANKS)) or "lora_r" in pinned)


def _search(spec, gpu: Gpu, pinned: dict, opts: dict) -> Search:
    budget = budget_bytes(gpu.memory_bytes, opts["headroom"])
    per_rank = max(1, math.ceil(opts["effective_batch"] / world_size(pinned)))
    return Search(spec, gpu, opts["seq_len"], per_rank, opts["prefer"], pinned, opts["estimator"], budget,
                   opts["host_budget"])


def _plan_at(spec, gpu: Gpu, pinned: dict, opts: dict) -> Plan:
    """The best plan with the GPU count (and any sharding) fixed by `pinned` (see plan; opts: its settings)."""
    seq_len, effective_batch, prefer, headroom = (opts[k] for k in ("seq_len", "effective_batch", "prefer", "headroom"))
    usable, reserve, budget = split(gpu.memory_bytes, headroom)
    search = _search(spec, gpu, pinned, opts)
    setups = Pool(seq_len, gpu.bf16, pinned)
    common = dict(model=spec.model_id, gpu=gpu, prefer=prefer, effective_batch=effective_batch, headroom=headroom,
                  usable_bytes=usable, headroom_bytes=reserve, budget_bytes=budget, pinned=dict(pinned, seq_len=seq_len))

    if prefer == "memory":  # the key needs each candidate's batch-1 total: no bound to prune with
        order = list(range(len(setups)))
    else:
        bounds = [search.optimistic_key(f) for f in setups.fields]
        order = sorted(range(len(setups)), key=lambda i: (bounds[i], i))
    results: dict[int, Candidate] = {}
    model_errors: list[str] = []
    best: Candidate | None = None
    best_i = -1
    for i in order:
        if best is not None and prefer != "memory" and bounds[i] > best.key:
            break
        if setups[i] is None:  # an invalid combination of pins and searched values
            continue
        try:
            c = search.evaluate(setups[i])
        except MemplanError as e:  # a model-dependent problem (e.g. no sdpa): the candidate does not apply
            model_errors.append(str(e))
            continue
        results[i] = c
        if c.fits and (best is None or c.key < best.key):
            best, best_i = c, i
    if not results:
        if not model_errors and setups.error:
            raise setups.error
        raise BadInput(model_errors[0] if model_errors else "no candidate setup applies to this model")
    if best is None:
        return nothing_fits(search, setups, results, common)
    if prefer == "memory":
        order = sorted(results, key=lambda i: (not results[i].fits, results[i].key, i))
    alts = alternatives(search, setups, results, best_i, order, opts["alternatives"])
    return Plan(setup=best.setup, estimate=best.estimate, alternatives=alts, evaluated=search.evaluated, **common)


def alternatives(search: Search, setups, results, best_i: int, order, limit: int) -> tuple[Alternative, ...]:
    """What the choice beat: the most preferred candidate that does not fit and the one just above the choice
    (what more memory would buy), then the runner-up in preference order and the best fitting candidate of each
    other technique, each with the reason it lost."""
    best = results[best_i]
    out: list[Alternative] = []
    pos = order.index(best_i)
    failing = [results[i] for i in order[:pos] if i in results and not results[i].fits]
    for c in failing[:1] + failing[-1:] if len(failing) > 1 else failing:
        out.append(Alternative(c.setup, False, c.need_bytes,
                               f"does not fit: needs {fmt_gib(c.need_bytes)} at micro-batch "
                               f"{c.setup.batch_size}, budget {fmt_gib(search.budget)}"))

    def first_fitting(indices) -> Candidate | None:
        for i in indices:
            if i == best_i:
                continue
            if i not in results:
                if setups[i] is None:
                    continue
                try:
                    results[i] = search.evaluate(setups[i])
                except MemplanError:
                    continue
            if results[i].fits:
                return results[i]
        return None

    runners = [first_fitting(order[pos + 1:])]
    for tech in TECHNIQUE_ORDER:
        if tech != best.setup.technique:
            runners.append(first_fitting(i for i in order if setups.fields[i]["technique"] == tech))
    seen = set()
    for c in runners:
        if c is not None and c.setup not in seen and len(out) < limit + 2:
            seen.add(c.setup)
            out.append(Alternative(c.setup, True, c.need_bytes, lost_reason(c, best, search.prefer)))
    return tuple(out)


def nothing_fits(search: Search, setups, results, common) -> Plan:
    """Nothing fits: the setup needing least memory at micro-batch 1, and what would make it fit."""
    smallest = min(results.values(), key=lambda c: c.need_bytes)
    need = smallest.need_bytes
    s = smallest.setup
    tips = []
    headroom = common["headroom"]
    bigger = sorted((g for g in load_gpus() if budget_bytes(g.memory_bytes, headroom) >= need),
                    key=lambda g: g.memory_bytes)
    if bigger:
        tips.append(f"a larger GPU: {bigger[0].name} ({fmt_gib(bigger[0].memory_bytes)}) fits {describe(s)}")
    shorter = _largest_seq_len(search, s)
    if shorter:
        tips.append(f"a shorter sequence: --seq-len {shorter} fits on this GPU ({describe(dataclasses.replace(s, seq_len=shorter))})")
    if s.world_size == 1:
        tips.append("more GPUs: sharding the model (DeepSpeed ZeRO-3 / FSDP) splits weights and optimizer state; "
                    "`memplan plan` without --num-gpus finds the fewest GPUs that fit, --num-gpus N plans for N")
    else:
        tips.append(f"more GPUs than {s.world_size}, or CPU offload with more host RAM (--host-memory)")
    alt = Alternative(s, False, need, f"needs {fmt_gib(need)} at micro-batch 1; budget {fmt_gib(search.budget)}")
    return Plan(setup=None, estimate=None, evaluated=search.evaluated, smallest=alt, suggestions=tuple(tips), **common)


def _largest_seq_len(search: Search, s: Setup) -> int:
    """Largest seq_len below the current one at which `s` fits at micro-batch 1 (0 if none >= 16)."""
    def fits_at(n: int) -> bool:
        try:
            return fits(search.estimate(dataclasses.replace(s, seq_len=n)), search.budget)
        except MemplanError:
            return False

    lo, hi = 16, s.seq_len  # invariant once checked: lo fits, hi does not
    if not fits_at(lo):
        return 0
    while hi - lo > 16:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo // 16 * 16 if lo >= 32 else lo
