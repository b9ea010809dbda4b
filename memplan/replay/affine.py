"""A training setup's allocation events as a function of its micro-batch, so that one setup shape (the Setup less its
micro-batch) traced once answers the allocator replay at every micro-batch and on every card.

Measured (session 36, transformers 5.24 on fake tensors): from micro-batch 2 on, a plain training run's events come in
the same order for the same storages, and each event's size is affine in the micro-batch - Qwen2.5-0.5B LoRA
checkpointed at 7 and 24 from traces at 2 and 3: 0 of 52,540 sizes off; gpt2 full at 6: 0 of 7,816. Micro-batch 1
differs (kernels pick other paths for one sample), and TRL's DPO adds events per sample. So the events at 2 and 3
are traced and a third micro-batch checks the line, event by event, before a shape is trusted; a shape that fails
is recorded as such and its setups are traced one by one (memplan.replay.need).

Cached on disk (cache_dir()/shapes) under the replay's own content key with the micro-batch taken out and the
accumulation as the trace runs it (min(grad_accum, 2): memplan.runtime.steps.run_steps).
"""
from __future__ import annotations

import array
import base64
import dataclasses
import sys
import zlib

#: the two micro-batches a shape is traced at (1 is no point of the line: see the module docstring)
BASES = (2, 3)
#: the micro-batch that checks the line when the one asked for is a base
CHECK = 4


def applies(setup) -> bool:
    """Whether setup's events can come from its shape's line: training at micro-batch 2 or more, outside TRL's DPO
    (its events grow by about a hundred per sample: Qwen2.5-0.5B LoRA, session 36) and GRPO (whose micro-batch
    holds whole generation groups, so 2 and 3 are no valid setups of it)."""
    return setup.mode == "train" and setup.batch_size >= 2 and setup.trainer not in ("dpo", "grpo")


def shape_of(setup) -> dict:
    """The Setup's fields that decide its line: all but the micro-batch, accumulation as the trace runs it."""
    return {**setup.to_dict(), "batch_size": None, "grad_accum": min(setup.grad_accum, 2)}


def at(setup, batch_size: int):
    """setup at another micro-batch (its accumulation kept: the shape does not depend on it beyond 1 or more)."""
    return dataclasses.replace(setup, batch_size=batch_size)


@dataclasses.dataclass(frozen=True)
class Line:
    """A shape's events: storage ids numbered by first event, phases, and each size at micro-batch BASES[0] and its
    growth per sample (0 for frees)."""
    ids: tuple[int, ...]
    phases: tuple[str, ...]
    base: tuple[int, ...]
    slope: tuple[int, ...]

    def events(self, batch_size: int) -> list[tuple] | None:
        """The events at batch_size (StorageTracker.events' 3-tuples), or None where a size would not be positive."""
        k = batch_size - BASES[0]
        sizes = [b + k * s for b, s in zip(self.base, self.slope)]
        if any(n <= 0 and b > 0 for n, b in zip(sizes, self.base)):
            return None
        return list(zip(self.ids, sizes, self.phases))


def _numbered(events) -> tuple[list[int], list[int], list[str]]:
    """events' storages renumbered by birth (the replay needs identity only; a free of a storage never born, which
    the replay skips, is -1), sizes, phases; each run of frees within a phase in id order (which storage goes first
    does not change the allocator's state after the run: freed blocks merge with free neighbours either way, and
    Python frees the garbage of one moment in no fixed order)."""
    ids: dict = {}
    out: list[tuple[int, int, str]] = []
    run: list[tuple[int, int, str]] = []
    for serial, n, phase in events:
        if run and (n or phase != run[0][2]):
            out += sorted(run)
            run = []
        if n:
            out.append((ids.setdefault(serial, len(ids)), n, phase))
        else:
            run.append((ids.get(serial, -1), 0, phase))
    out += sorted(run)
    return [e[0] for e in out], [e[1] for e in out], [e[2] for e in out]


def line_through(first, second) -> Line | None:
    """The line through the events traced at BASES, or None where they are not the same run (storages, order,
    phases or which events free)."""
    ids, sizes2, phases = _numbered(first)
    ids3, sizes3, phases3 = _numbered(second)
    if ids != ids3 or phases != phases3 or any((a == 0) != (b == 0) for a, b in zip(sizes2, sizes3)):
        return None
    per = BASES[1] - BASES[0]
    if any((b - a) % per for a, b in zip(sizes2, sizes3)):
        return None
    return Line(tuple(ids), tuple(phases), tuple(sizes2), tuple((b - a) // per for a, b in zip(sizes2, sizes3)))


def holds(line: Line, batch_size: int, traced) -> bool:
    """Whether the events traced at batch_size are the line's, event by event."""
    made = line.events(batch_size)
    return made is not None and list(zip(*_numbered(traced))) == made


def _pack(values) -> str:
    data = array.array("q", values)
    if sys.byteorder != "little":
        data.byteswap()
    return base64.b64encode(zlib.compress(data.tobytes(), 6)).decode()


def _unpack(text: str) -> tuple[int, ...]:
    data = array.array("q")
    data.frombytes(zlib.decompress(base64.b64decode(text)))
    if sys.byteorder != "little":
        data.byteswap()
    return tuple(data)


def to_json(line: Line | None) -> dict:
    """What the shape cache stores: the line, packed (a 7B model's 3 steps hold a few hundred thousand events), or
    that the shape has none."""
    if line is None:
        return {"affine": False}
    names = sorted(set(line.phases))
    return {"affine": True, "phase_names": names, "ids": _pack(line.ids), "base": _pack(line.base),
            "slope": _pack(line.slope), "phases": _pack(names.index(p) for p in line.phases)}


def from_json(data) -> Line | None | bool:
    """The cached line; None for a shape recorded as not affine; False for an entry that is not one of ours."""
    try:
        if data.get("affine") is False:
            return None
        names = data["phase_names"]
        line = Line(_unpack(data["ids"]), tuple(names[i] for i in _unpack(data["phases"])), _unpack(data["base"]),
                    _unpack(data["slope"]))
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, zlib.error):
        return False
    if not len(line.ids) == len(line.phases) == len(line.base) == len(line.slope):
        return False
    return line
