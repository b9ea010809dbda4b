"""`memplan plan --replay`: the planner's micro-batch checked against the caching allocator itself.

The search (memplan.planner.search) keeps a setup when its closed-form need - peak allocated + a fresh block for
the largest tensor + the device-only memory (memplan.planner.budget) - is within the budget. Whether a step really
fits under a cap depends on how the caching allocator splits and caches its segments; the closed form bounds that
from above and is loose where the largest tensor finds a cached block to reuse. Here the events of the steps
validate runs (a deep model's synthesized from a 5-block trace: memplan.replay.synth) are replayed through
memplan.runtime.allocator under the budget's allocator share for each micro-batch probed, and the micro-batch
becomes the largest whose replay fits.
Single-GPU plans only (one rank's trace is the whole step there); about a second per probe on 2 CPU cores once a
setup's first call has run (benchmarks/results/speed.md, synth_check.md).
"""
from __future__ import annotations

import dataclasses
import math

from memplan.planner.candidates import grpo_accum, grpo_batch_unit, split_batch
from memplan.planner.types import Plan
from memplan.replay.need import replay_need as traced

#: training steps replayed per micro-batch: what `memplan validate` runs (the optimizer state exists from the
#: first step's end, and the caches of later steps are what fragments)
STEPS = 3


def allocator_limit(plan: Plan) -> int:
    """The caching allocator's share of the budget: the budget less the device-only memory of the chosen setup
    (CUDA context, paged optimizer state, NCCL buffers: Estimate.device_total_bytes - peak_reserved_bytes)."""
    e = plan.estimate
    return plan.budget_bytes - (e.device_total_bytes - e.peak_reserved_bytes)


def replay_need(spec, setup, cached_only: bool = False) -> tuple[int, int]:
    """The replayed need of STEPS traced steps of `setup` (memplan.replay.need.replay_need; cached on disk).
    cached_only: raise memplan.replay.need.NotCached rather than trace.

    Returns:
        (need bytes, reserved bytes)."""
    return traced(spec, setup, STEPS, cached_only)


def cached_replay_need(spec, setup) -> tuple[int, int]:
    """replay_need from the disk cache only (plan's default: the replay when it costs no trace)."""
    return replay_need(spec, setup, cached_only=True)


def refine(plan: Plan, spec, estimator, replay_fn=replay_need) -> Plan:
    """`plan` with its micro-batch (and accumulation) set by allocator replays; the plan as it is when it does not
    fit or spans several GPUs. replay_fn(spec, setup) -> (need bytes, reserved bytes) as replay_need.

    Each probe's need (not only fit or not) guides the next: from the plan's micro-batch b0 the first guess is
    b0 + (limit - need(b0)) / the closed form's need per sample, then regula falsi (_search), which takes fewer
    traces than stepping 1, 2, 4 from b0 and bisecting."""
    if not plan.fits:
        return plan
    if plan.setup.world_size > 1:
        return dataclasses.replace(plan, replay={"skipped": "the allocator replay covers single-GPU plans; this plan "
                                                            f"spans {plan.setup.world_size} GPUs"})
    limit = allocator_limit(plan)
    pinned_ga = plan.pinned.get("grad_accum")
    effective = plan.effective_batch
    needs: dict[int, tuple[int, int]] = {}
    # GRPO: whole groups of num_generations per generation batch (micro-batch x accumulation), as the search keeps
    # (a pinned accumulation holds them at the unit's multiples: grpo_accum leaves it as it is)
    unit = grpo_batch_unit(plan.pinned)

    def setup_at(b: int):
        ga = grpo_accum(plan.pinned, b, pinned_ga or max(1, math.ceil(effective / b)))
        return dataclasses.replace(plan.setup, batch_size=b, grad_accum=ga)

    def fits(b: int) -> bool:
        if b not in needs:
            needs[b] = replay_fn(spec, setup_at(b))
        return needs[b][0] <= limit

    b0 = plan.setup.batch_size
    if plan.pinned.get("batch_size"):
        largest = b0 if fits(b0) else 0
    else:  # searched in units (whole GRPO groups where the accumulation is pinned; else single samples)
        cap = (math.ceil(effective / pinned_ga) if pinned_ga else effective) // unit
        units: dict[int, tuple[int, int]] = {}

        def fits_units(k: int) -> bool:
            ok = fits(k * unit)
            units[k] = needs[k * unit]
            return ok
        k0 = b0 // unit
        fits_units(k0)
        rate = _rate(plan, spec, estimator, setup_at, cap * unit, unit)
        largest = unit * _search(units, fits_units, limit, cap, _guess(k0, rate, units[k0][0], limit, cap), rate)
    record = {"limit_bytes": limit, "estimate_batch_size": b0, "largest_batch_size": largest,
              "replayed": {b: {"fits": n <= limit, "need_bytes": n, "reserved_bytes": r}
                           for b, (n, r) in sorted(needs.items())}}
    if largest == 0:  # not even the pinned or smallest micro-batch fits the replay: keep the plan, say so
        return dataclasses.replace(plan, replay=record)
    if plan.pinned.get("batch_size") or pinned_ga:
        b, ga = largest, setup_at(largest).grad_accum
    else:
        b, ga = split_batch(effective, largest)
        ga = grpo_accum(plan.pinned, b, ga)
    setup = dataclasses.replace(plan.setup, batch_size=b, grad_accum=ga)
    record.update(batch_size=b, grad_accum=ga)
    return dataclasses.replace(plan, setup=setup, estimate=estimator(spec, setup), replay=record)


def _rate(plan: Plan, spec, estimator, setup_at, cap: int, unit: int = 1) -> int:
    """The closed form's need per `unit` samples at the plan's micro-batch (its bound moves with the activations as
    the replay's need does); 0 where the plan's micro-batch is the cap."""
    b0 = plan.setup.batch_size
    nxt = min(b0 + unit, cap)
    return (estimator(spec, setup_at(nxt)).allocator_need_bytes - plan.estimate.allocator_need_bytes) if nxt > b0 else 0


def _guess(b0: int, rate: int, need0: int, limit: int, cap: int) -> int:
    """The micro-batch where the replayed need at the plan's b0 would reach the limit, growing at `rate` per sample."""
    if rate <= 0:
        return b0 + 1 if b0 < cap else b0
    guess = max(1, min(cap, b0 + math.floor((limit - need0) / rate)))
    if guess == b0 and need0 <= limit and b0 < cap:  # room for less than a sample: the neighbour decides
        return b0 + 1  # (probing b0 again leaves _search nothing to interpolate: it would bisect up to the cap)
    return guess


def _search(needs: dict, fits, limit: int, cap: int, guess: int, rate: float = 0.0) -> int:
    """The largest micro-batch in [1, cap] whose need is within the limit (0 if none): probe the guess, then the
    micro-batch where the line through the two nearest probes on either side of the limit meets it (regula falsi
    on integers; a probe always lands strictly between the largest known fit and the smallest known OOM). Where
    those two probes' needs do not grow (the allocator's fragmentation can make a larger micro-batch need less),
    the line grows at `rate` per sample (the closed form's), else the interval is bisected: Qwen2.5-1.5B QLoRA on
    an RTX 4060 Ti 16GB probed 5, 6, then bisected from the cap of 512 (10 probes, 8.8 s) where 7 decides."""
    fits(guess)
    while True:
        ok = [b for b in needs if needs[b][0] <= limit]
        oom = [b for b in needs if needs[b][0] > limit]
        lo, hi = max(ok, default=0), min(oom, default=cap + 1)
        if hi - lo <= 1 or lo >= cap:
            return min(lo, cap)
        anchor = lo or hi  # the largest fit, or with none the smallest OOM
        near = sorted(sorted(needs, key=lambda b: abs(b - anchor))[:2])
        slope = float(rate)
        if len(near) == 2 and needs[near[1]][0] > needs[near[0]][0]:
            slope = (needs[near[1]][0] - needs[near[0]][0]) / (near[1] - near[0])
        step = math.floor((limit - needs[anchor][0]) / slope) if slope > 0 else (hi - lo) // 2
        nxt = min(max(anchor + step, lo + 1), hi - 1)
        fits(nxt)
