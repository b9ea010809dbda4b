"""GRPO's generate() without tracing every token (for the caching-allocator replay, memplan.runtime.allocator): a
run that generates max_completion_length tokens is made from runs that generate a few.

generate() calls the model once for the prompt (prefill), then once per new token; the events from one call's start
to the next are a window. From the first decode step on, the windows of a run allocate the same storages in the same
order, each of a size affine in the step (the KV cache and the running ids grow by a token a step), and each frees
what the window before it allocated (SmolLM2-135M LoRA: 1,483 allocations a window). So the events at TRACED[0]
tokens give the windows up to TEMPLATE as traced and the template window with its growth per step; the last window
(where generate() stops and returns) comes from the same run and, for its growth per token generated, from the run
at TRACED[1]. A free is remapped by its distance: the template's free of what the window before allocated frees,
in copy t, what copy t - 1 allocated. The rest of the step (the loss over prompt + completion tokens) runs at the
setup's own length in every run, so only the generation phases change.

Checked, not assumed: a shape's first synthesis reproduces a run at CHECK tokens event by event (canonical, as
memplan.replay.synth checks its blocks); anything else, and the caller traces the whole generation - as it does
where a layer's cache stops growing within the completion (a sliding window, attention chunks), past any check here.
"""
from __future__ import annotations

import json

from memplan.model.catalog import config_dict
from memplan.replay.synth import canonical, through_last_step
from memplan.setup import prompt_tokens

#: generated tokens of the two runs the windows come from, and of the run a shape's first synthesis must reproduce
TRACED = (8, 9)
CHECK = 12
#: windows 0 (prefill) to TEMPLATE - 1 as traced; TEMPLATE's run copied for every step up to the last but one
TEMPLATE = 3
#: completions shorter than this are traced whole: the runs here trace the rest of the step three times (SmolLM2-135M
#: GRPO LoRA: 57 s for the three, 35 s for one run generating 24 tokens, about 0.75 s a token)
MIN_TOKENS = 64
_verified: dict[tuple, bool] = {}


class _Mismatch(Exception):
    """The runs' windows do not allocate alike."""


def applies(setup) -> bool:
    """GRPO generating with generate() (vLLM's engine is not traced) a completion long enough to pay."""
    return (setup.mode == "train" and setup.trainer == "grpo" and not setup.use_vllm
            and setup.max_completion_length >= MIN_TOKENS)


def events(spec, setup, steps: int, run) -> list | None:
    """The run's events (StorageTracker.events form) at setup.max_completion_length tokens, synthesized, or None where
    the windows do not allocate alike or the check fails (module docstring). run(tokens) -> (events, call starts):
    a traced run generating `tokens` tokens, the rest of the step at the setup's length."""
    key = (spec.model_id, json.dumps({**setup.to_dict(), "batch_size": None}, sort_keys=True, default=str), steps)
    if _verified.get(key) is False or _windowed(config_dict(spec), prompt_tokens(setup) + setup.max_completion_length):
        return None
    try:
        a, b = run(TRACED[0]), run(TRACED[1])
        if key not in _verified:
            check, _ = run(CHECK)
            _verified[key] = canonical(through_last_step(synthesize(a, b, CHECK))) == \
                canonical(through_last_step(check))
        return synthesize(a, b, setup.max_completion_length) if _verified[key] else None
    except _Mismatch:
        _verified[key] = False
        return None


def _windowed(d: dict, length: int) -> bool:
    """Whether a layer's cache stops growing before `length` tokens (a sliding window, Llama 4's attention chunks):
    the steps past it are not the template's."""
    for c in (d, d.get("text_config") or {}):
        for name in ("sliding_window", "attention_chunk_size"):
            if isinstance(c.get(name), int) and c[name] < length:
                return True
    return False


def _generations(events, calls) -> list[tuple[int, list[int], int]]:
    """Per generation phase: (its first event, the starts of its windows, its end)."""
    out, start = [], None
    for i, (_, _, phase) in enumerate([*events, (None, 0, "")]):
        if phase == "generation" and start is None:
            start = i
        elif phase != "generation" and start is not None:
            out.append((start, [c for c in calls if start <= c < i], i))
            start = None
    return out


def synthesize(a: tuple, b: tuple, tokens: int) -> list[tuple]:
    """The events of run `a` (events, call starts; TRACED[0] tokens) with each generation made `tokens` long; run `b`
    (TRACED[1] tokens) gives the last window's growth per token.

    Raises:
        _Mismatch where the runs' generations or windows do not line up."""
    (ea, ca), (eb, cb) = a, b
    ga, gb = _generations(ea, ca), _generations(eb, cb)
    n = TRACED[0]
    if len(ga) != len(gb) or any(len(w) != n for _, w, _ in ga) or any(len(w) != n + 1 for _, w, _ in gb):
        raise _Mismatch("a generation does not call the model once per token")
    born: dict = {}  # serial born in a window of run a -> (generation, window, ordinal among its births)
    serial: dict = {}  # (generation, window, ordinal) -> run a's serial
    wins = []  # per generation: run a's windows
    for g, (_, starts, end) in enumerate(ga):
        bounds = [*starts, end]
        wins.append([ea[bounds[k]:bounds[k + 1]] for k in range(n)])
        for k, win in enumerate(wins[g]):
            for j, s in enumerate(s for s, size, _ in win if size):
                born[s], serial[g, k, j] = (g, k, j), s
        for k in range(1, n - 1):  # the decode steps before the last allocate alike
            _alike(wins[g][TEMPLATE], wins[g][k])
        _alike(wins[g][n - 1], eb[gb[g][1][-1]:gb[g][2]])

    def moved(s, g, home: int, at: int):
        """What run a's free of s, seen in window `home` of generation g (None: outside the windows, seen from the
        last window of s's own generation), frees in window `at` of the synthesized run: the storage of the window
        as far before `at` as s's was before `home`; run a's own where that window is traced (before TEMPLATE, and
        the last window) and for the prefill's storages, which are no step's."""
        if s not in born:
            return s
        bg, k, j = born[s]
        if k in (0, n - 1):  # the prefill's (autocast's weight casts, freed as generate() returns) and the last's
            return s
        if g is None or bg != g:
            return s if k < TEMPLATE else ("d", bg, tokens - n + k, j)
        target = at - (home - k)  # never before k: a window frees what it or an earlier one allocated
        return serial[bg, target, j] if target < TEMPLATE else ("d", bg, target, j)

    out: list[tuple] = []
    pos, last = 0, tokens - 1
    for g, (_, starts, end) in enumerate(ga):
        for s, size, phase in ea[pos:starts[0]]:  # up to the prefill's call
            out.append((s, size, phase) if size else (moved(s, None, 0, 0), 0, phase))
        for k in range(TEMPLATE):  # the prefill and the first decode steps as traced
            out += [(s, size, phase) if size else (moved(s, g, k, k), 0, phase) for s, size, phase in wins[g][k]]
        template, following = wins[g][TEMPLATE], wins[g][TEMPLATE + 1]
        for t in range(TEMPLATE, last):
            j = 0
            for (s, size, phase), (_, nxt, _) in zip(template, following):
                if size:
                    out.append((("d", g, t, j), size + (t - TEMPLATE) * (nxt - size), phase))
                    j += 1
                else:
                    out.append((moved(s, g, TEMPLATE, t), 0, phase))
        last_b = eb[gb[g][1][-1]:gb[g][2]]
        for (s, size, phase), (_, size_b, _) in zip(wins[g][n - 1], last_b):
            out.append((s, size + (tokens - n) * (size_b - size), phase) if size else
                       (moved(s, g, n - 1, last), 0, phase))
        pos = end
    out += [(s, size, phase) if size else (moved(s, None, 0, 0), 0, phase) for s, size, phase in ea[pos:]]
    return out


def _alike(x: list, y: list) -> None:
    """Two windows allocate alike: as many events, births and frees at the same places."""
    if len(x) != len(y) or any((p[1] == 0) != (q[1] == 0) or p[2] != q[2] for p, q in zip(x, y)):
        raise _Mismatch("windows of different events")
