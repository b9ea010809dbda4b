"""`memplan plan --replay`: the planner's micro-batch checked against the caching allocator itself.

The search (memplan.search) keeps a setup when its closed-form need - peak allocated + a fresh block for the
largest tensor + the device-only memory (memplan.budget) - is within the budget. Whether a step really fits under a
cap depends on how the caching allocator splits and caches its segments; the closed form bounds that from above and
is loose where the largest tensor finds a cached block to reuse (gpt2-xl on an A10: 21 planned, 24 fitted on the
H200 capped to the card, data/measured/planner-check.csv). Here the chosen setup is traced at whole depth for the
steps validate runs, each micro-batch replayed through memplan.allocator under the budget's allocator share, and
the micro-batch becomes the largest whose replay fits. Single-GPU plans only (one rank's trace is the whole
step there); seconds per replay on the CPU for a 1B model, about 20 s for a 7B QLoRA.
"""
from __future__ import annotations

import dataclasses
import math

from memplan.candidates import split_batch
from memplan.fit import largest_fitting
from memplan.plan_types import Plan

#: training steps replayed per micro-batch: what `memplan validate` runs (the optimizer state exists from the
#: first step's end, and the caches of later steps are what fragments)
STEPS = 3


def allocator_limit(plan: Plan) -> int:
    """The caching allocator's share of the budget: the budget less the device-only memory of the chosen setup
    (CUDA context, paged optimizer state, NCCL buffers: Estimate.device_total_bytes - peak_reserved_bytes)."""
    e = plan.estimate
    return plan.budget_bytes - (e.device_total_bytes - e.peak_reserved_bytes)


def refine(plan: Plan, spec, estimator, replay_fn=None) -> Plan:
    """`plan` with its micro-batch (and accumulation) set by allocator replays; the plan as it is when it does not
    fit or spans several GPUs. replay_fn(spec, setup, limit) -> memplan.allocator.Replay (default:
    memplan.trace.replay_allocator over STEPS steps)."""
    if not plan.fits:
        return plan
    if plan.setup.world_size > 1:
        return dataclasses.replace(plan, replay={"skipped": "the allocator replay covers single-GPU plans; this plan "
                                                            f"spans {plan.setup.world_size} GPUs"})
    if replay_fn is None:
        from memplan.trace import replay_allocator

        def replay_fn(spec, setup, limit):
            return replay_allocator(spec, setup, limit, STEPS)
    limit = allocator_limit(plan)
    pinned_ga = plan.pinned.get("grad_accum")
    effective = plan.effective_batch
    replays: dict[int, object] = {}

    def setup_at(b: int):
        return dataclasses.replace(plan.setup, batch_size=b, grad_accum=pinned_ga or max(1, math.ceil(effective / b)))

    def fits(b: int) -> bool:
        if b not in replays:
            replays[b] = replay_fn(spec, setup_at(b), limit)
        return not replays[b].oom

    if plan.pinned.get("batch_size"):
        largest = plan.setup.batch_size if fits(plan.setup.batch_size) else 0
    else:
        cap = math.ceil(effective / pinned_ga) if pinned_ga else effective
        largest = largest_fitting(fits, cap, start=plan.setup.batch_size)
    record = {"limit_bytes": limit, "estimate_batch_size": plan.setup.batch_size, "largest_batch_size": largest,
              "replayed": {b: {"fits": not r.oom, "reserved_bytes": r.peak_reserved} for b, r in sorted(replays.items())}}
    if largest == 0:  # not even the pinned or smallest micro-batch fits the replay: keep the plan, say so
        return dataclasses.replace(plan, replay=record)
    if plan.pinned.get("batch_size") or pinned_ga:
        b, ga = largest, setup_at(largest).grad_accum
    else:
        b, ga = split_batch(effective, largest)
    setup = dataclasses.replace(plan.setup, batch_size=b, grad_accum=ga)
    record.update(batch_size=b, grad_accum=ga)
    return dataclasses.replace(plan, setup=setup, estimate=estimator(spec, setup), replay=record)
