"""memplan.replay.decode: GRPO's generate() of many tokens made from runs that generate a few (integration test:
tests/integration/test_synth.py)."""
from __future__ import annotations

import pytest

from memplan.replay import decode
from memplan.replay.synth import through_last_step, canonical


def _run(tokens: int, prompt: int = 5, generations: int = 2, quirk: bool = False, casts: bool = False
         ) -> tuple[list, list[int]]:
    """A training run's events with `generations` generate() calls of `tokens` tokens each: the cache grows a
    token a step (a new storage, the last one freed), a temporary per step, the ids kept to the end of the step.
    quirk: the fifth decode step allocates once more (windows that do not allocate alike); casts: the prefill makes
    a weight cast that lives to the end of generate() (autocast's cache, full fine-tuning)."""
    events, calls, serial = [], [], iter(range(10**6))
    for _ in range(generations):
        ids = next(serial)
        events.append((ids, 8 * prompt, "generation"))
        cache = None
        cast = None
        for t in range(tokens):
            calls.append(len(events))
            if casts and t == 0:
                cast = next(serial)
                events.append((cast, 4096, "generation"))
            new = next(serial)
            events.append((new, 64 * (prompt + t), "generation"))
            if cache is not None:
                events.append((cache, 0, "generation"))
            cache = new
            tmp = next(serial)
            events += [(tmp, 100, "generation"), (tmp, 0, "generation")]
            if quirk and t == 5:
                extra = next(serial)
                events += [(extra, 4, "generation"), (extra, 0, "generation")]
        out = next(serial)
        events.append((out, 8 * (prompt + tokens), "generation"))
        if cast is not None:
            events.append((cast, 0, "generation"))
        loss = next(serial)
        events += [(loss, 1000, "forward"), (cache, 0, "forward"), (loss, 0, "backward"), (out, 0, "backward"),
                   (ids, 0, "zero_grad")]
    return events, calls


@pytest.mark.parametrize("tokens", [12, 9, 40])
@pytest.mark.parametrize("casts", [False, True])
def test_windows_copied_and_frees_remapped(tokens, casts):
    # the prefill's storages freed in the last window stay themselves (Llama-3.2-1B GRPO full: autocast's casts)
    made = decode.synthesize(_run(8, casts=casts), _run(9, casts=casts), tokens)
    assert canonical(through_last_step(made)) == canonical(through_last_step(_run(tokens, casts=casts)[0]))


def test_windows_that_differ_are_refused():
    with pytest.raises(decode._Mismatch):
        decode.synthesize(_run(8, quirk=True), _run(9, quirk=True), 20)


def test_a_shape_that_fails_its_check_is_traced_whole(monkeypatch):
    from types import SimpleNamespace

    from memplan.setup import Setup
    monkeypatch.setattr(decode, "_verified", {})
    monkeypatch.setattr(decode, "config_dict", lambda spec: {"sliding_window": 4096})
    spec = SimpleNamespace(model_id="m")
    setup = Setup(trainer="grpo", technique="lora", batch_size=4, max_completion_length=64, num_generations=4)
    assert decode.applies(setup) and not decode.applies(Setup(trainer="grpo", batch_size=4, num_generations=4,
                                                              max_completion_length=32))
    ran = []

    def run(tokens):
        ran.append(tokens)
        return _run(tokens)
    assert canonical(decode.events(spec, setup, 3, run)) == canonical(_run(64)[0])
    assert ran == [8, 9, 12]
    assert decode.events(spec, setup, 3, run) is not None and ran[3:] == [8, 9]  # the check runs once per shape
    monkeypatch.setattr(decode, "_verified", {})
    assert decode.events(spec, setup, 3, lambda tokens: _run(tokens, quirk=tokens == 12)) is None


def test_a_cache_that_stops_growing_is_not_synthesized():
    # a sliding window (Gemma-3's 512 tokens) or Llama 4's attention chunks shorter than prompt + completion: the
    # steps past it allocate otherwise
    assert decode._windowed({"sliding_window": 512}, 768)
    assert decode._windowed({"text_config": {"attention_chunk_size": 8192}}, 9000)
    assert not decode._windowed({"sliding_window": None, "text_config": {"sliding_window": 4096}}, 768)
