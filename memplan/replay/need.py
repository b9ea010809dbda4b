"""The caching-allocator replay (memplan.runtime.allocator) over a training run's allocation events: the events of
the whole model (traced, or synthesized from a cut trace: memplan.replay.synth), their replay with the cuBLAS
workspaces, and the smallest allocator limit they fit under. A replay's result is cached on disk by content
(cache_dir()/replays): the model's config, the whole Setup, the source and releases that trace it; a training
setup's events come from its shape's line where it has one (memplan.replay.affine: traced once, every micro-batch)."""
from __future__ import annotations

import dataclasses
import functools
import json

from memplan.replay import affine, decode
from memplan.fileio import content_key, read_cached, source_digest, write_cached
from memplan.runtime.allocator import need_and_replay, replayed
from memplan.setup import Setup
from memplan.model.catalog import config_dict, load_spec, spec_for_task
from memplan.model.compat import check_setup
from memplan.replay.synth import events as synthesized
from memplan.runtime.tracker import StorageTracker
from memplan.runtime.trl_step import GENERATED
from memplan.tracer.inference import inference_events
from memplan.tracer.training import run_traced


def traced_events(model, setup: Setup, steps: int, synthesize: bool = True):
    """The allocation events of `steps` traced training steps of the whole model (StorageTracker.events); GRPO's long
    generations synthesized from runs that generate a few tokens (memplan.replay.decode), a deep model's blocks from a
    trace cut to a few blocks (memplan.replay.synth), where that is exact; else traced whole.
    Inference setups: validate's prefill and generate() (memplan.tracer.inference; `steps` does not apply)."""
    spec = spec_for_task(load_spec(model), setup.task)
    check_setup(spec, setup)
    if setup.mode != "train":
        return inference_events(spec, setup)
    made = None
    if synthesize and decode.applies(setup):
        made = decode.events(spec, setup, steps, lambda tokens: _generating(spec, setup, steps, tokens))
    if synthesize and made is None:
        made = synthesized(spec, setup, steps)
    return made if made is not None else \
        run_traced(spec, setup, config_dict(spec), None, steps, True, tracker=StorageTracker(events=True)).events


def _generating(spec, setup: Setup, steps: int, tokens: int) -> tuple[list, list[int]]:
    """A traced run whose GRPO generations make `tokens` tokens: its events and where each call of the model starts
    (memplan.replay.decode)."""
    tracker = StorageTracker(events=True)
    tracker.calls = []
    token = GENERATED.set(tokens)
    try:
        run_traced(spec, setup, config_dict(spec), None, steps, True, tracker=tracker)
    finally:
        GENERATED.reset(token)
    return tracker.events, tracker.calls


#: what a traced replay depends on besides the model and the Setup: memplan's code that traces and replays it, and
#: the libraries whose code runs in the trace
_SOURCE = ("runtime", "tracer", "replay", "model", "inventory", "setup.py", "libs.py")
_PACKAGES = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate")


class NotCached(LookupError):
    """replay_need(cached_only=True) found no cached replay of the setup."""


@functools.cache
def _source() -> bytes:
    return source_digest(*_SOURCE)


def replay_key(spec, setup: Setup, steps: int) -> str:
    """The content key of a replay: the model's config.json content and task, the whole Setup, the step count, the
    tracing source and the library releases (fileio.content_key)."""
    return _key(spec, "setup", setup.to_dict(), steps)


def shape_key(spec, setup: Setup, steps: int) -> str:
    """The content key of a setup shape's line (memplan.replay.affine): replay_key less the micro-batch."""
    return _key(spec, "shape", affine.shape_of(setup), steps)


def _key(spec, name: str, setup: dict, steps: int) -> str:
    what = {"config": config_dict(spec), "model": spec.model_id, name: setup, "steps": steps}
    return content_key([json.dumps(what, sort_keys=True, default=str).encode(), _source()], _PACKAGES)


def run_events(spec, setup: Setup, steps: int, cached_only: bool = False):
    """The events of `steps` steps of setup: from its shape's line where it has one (cached, or fitted to traces at
    two or three micro-batches and checked at another, then cached: memplan.replay.affine.fit), else traced
    (traced_events).
    cached_only: raise NotCached rather than trace."""
    line, traced = None, {}
    if affine.applies(setup):
        key = shape_key(spec, setup, steps)
        line = affine.from_json(read_cached("shapes", key))
        if line is False:  # not cached
            if cached_only:
                raise NotCached(f"{spec.model_id}, micro-batch {setup.batch_size}")
            line = affine.fit(lambda b: traced_events(spec, affine.at(setup, b), steps), setup.batch_size, traced,
                              affine.unit(setup), affine.head_limit(setup))
            write_cached("shapes", key, affine.to_json(line))
    made = line.events(setup.batch_size) if line is not None else None
    if made is not None:
        return made
    if cached_only:
        raise NotCached(f"{spec.model_id}, micro-batch {setup.batch_size} " +
                        ("(its shape is traced per micro-batch)" if line is None else
                         f"(its shape's line is checked up to {line.upto})"))
    events = traced.get(setup.batch_size) or traced_events(spec, setup, steps)
    if line is not None and affine.holds(line, setup.batch_size, events):  # the line holds further: say so
        write_cached("shapes", key, affine.to_json(dataclasses.replace(line, upto=setup.batch_size)))
    return events


def replay_need(model, setup: Setup, steps: int = 3, cached_only: bool = False) -> tuple[int, int]:
    """The smallest allocator limit `steps` traced steps of `model` fit under, and their uncapped reserved peak.

    One whole-model trace, the limit bisected over replays of it (memplan.runtime.allocator.min_limit; cuBLAS
    workspaces included): the exact counterpart of Estimate.allocator_need_bytes and peak_reserved_bytes. Cached
    on disk (replay_key): a setup replayed before answers in milliseconds, one of a shape traced before (any
    micro-batch: memplan.replay.affine) in a fraction of a second to a few seconds. cached_only: raise NotCached
    rather than trace (seconds to a minute on the CPU).

    Returns:
        (need bytes, reserved bytes)."""
    spec = spec_for_task(load_spec(model), setup.task)
    key = replay_key(spec, setup, steps)
    hit = read_cached("replays", key)
    if isinstance(hit, dict) and isinstance(hit.get("need_bytes"), int) and isinstance(hit.get("reserved_bytes"), int):
        return hit["need_bytes"], hit["reserved_bytes"]
    need, free = need_and_replay(run_events(spec, setup, steps, cached_only))
    write_cached("replays", key, {"need_bytes": need, "reserved_bytes": free.peak_reserved,
                                  "model": spec.model_id, "setup": setup.to_dict(), "steps": steps})
    return need, free.peak_reserved


def replay_allocator(model, setup: Setup, limit: int | None = None, steps: int = 3):
    """The caching allocator's replay (memplan.runtime.allocator) over a traced run of the whole model: `steps`
    training steps as `memplan validate` runs them (3 by default), capped at `limit` bytes of reserved memory. The
    cuBLAS workspace of each handle is allocated at its first matmul: forward's thread, and autograd's in backward.
    Inference setups replay validate's prefill and generate()."""
    return replayed(traced_events(model, setup, steps), limit, setup.mode)
