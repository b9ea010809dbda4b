"""The caching-allocator replay (memplan.runtime.allocator) over a training run's allocation events: the events of
the whole model (traced, or synthesized from a cut trace: memplan.replay.synth), their replay with the cuBLAS
workspaces, and the smallest allocator limit they fit under."""
from __future__ import annotations

from memplan.runtime.allocator import need_and_replay, replayed
from memplan.setup import Setup
from memplan.model.catalog import config_dict, load_spec, spec_for_task
from memplan.model.compat import check_setup
from memplan.replay.synth import events as synthesized
from memplan.runtime.tracker import StorageTracker
from memplan.tracer.inference import inference_events
from memplan.tracer.training import run_traced


def traced_events(model, setup: Setup, steps: int, synthesize: bool = True):
    """The allocation events of `steps` traced training steps of the whole model (StorageTracker.events); for a deep
    model synthesized from a trace cut to a few blocks where that is exact (memplan.replay.synth), else traced whole.
    Inference setups: validate's prefill and generate() (memplan.tracer.inference; `steps` does not apply)."""
    spec = spec_for_task(load_spec(model), setup.task)
    check_setup(spec, setup)
    if setup.mode != "train":
        return inference_events(spec, setup)
    made = synthesized(spec, setup, steps) if synthesize else None
    return made if made is not None else \
        run_traced(spec, setup, config_dict(spec), None, steps, True, tracker=StorageTracker(events=True)).events


def replay_need(model, setup: Setup, steps: int = 3) -> tuple[int, int]:
    """The smallest allocator limit `steps` traced steps of `model` fit under, and their uncapped reserved peak.

    One whole-model trace, the limit bisected over replays of it (memplan.runtime.allocator.min_limit; cuBLAS
    workspaces included): the exact counterpart of Estimate.allocator_need_bytes and peak_reserved_bytes.

    Returns:
        (need bytes, reserved bytes)."""
    need, free = need_and_replay(traced_events(model, setup, steps))
    return need, free.peak_reserved


def replay_allocator(model, setup: Setup, limit: int | None = None, steps: int = 3):
    """The caching allocator's replay (memplan.runtime.allocator) over a traced run of the whole model: `steps`
    training steps as `memplan validate` runs them (3 by default), capped at `limit` bytes of reserved memory. The
    cuBLAS workspace of each handle is allocated at its first matmul: forward's thread, and autograd's in backward.
    Inference setups replay validate's prefill and generate()."""
    return replayed(traced_events(model, setup, steps), limit, setup.mode)
