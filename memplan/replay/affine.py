"""A training setup's allocation events as a function of its micro-batch, so that one setup shape (the Setup less its
micro-batch) traced once answers the allocator replay at every micro-batch and on every card.

Measured (benchmarks/results/affine_check.md, transformers 5.24 on fake tensors): from micro-batch 2 on, a training
run's events come in the same order for the same storages, and each event's size is affine in the micro-batch - or,
where a tensor spans the whole packed batch twice (TRL's packing under sdpa: a [b x s, b x s] mask), quadratic.
Micro-batch 1 differs (kernels pick other paths for one sample); TRL's fused head under DPO (a pass per 4,096 of the
chosen and rejected tokens) and Liger's fused cross-entropy step their chunk count with the tokens, and activation
offloading moves a free (applies() leaves them out); the head under SFT and GRPO keeps a line within its first pass
(head_limit()); GRPO's micro-batches come in whole generation groups, so its line runs over those (unit());
AWQ's kernel changes path at 1,024 tokens (the checks find it). So the events at 2 and 3 give a line, checked event
by event at the micro-batch asked for and at far_check of it before a shape is trusted; where a check fails, the
events at 4 give the curve through 2, 3 and 4, checked likewise; a shape that fails both is recorded as such and its
setups are traced one by one (memplan.replay.need). A line answers up to the largest micro-batch it was checked at;
a trace past it that agrees extends it.

Cached on disk (cache_dir()/shapes) under the replay's own content key with the micro-batch taken out and the
accumulation as the trace runs it (min(grad_accum, 2): memplan.runtime.steps.run_steps).
"""
from __future__ import annotations

import array
import base64
import dataclasses
import math
import sys
import zlib

from memplan.runtime.trl import scored
from memplan.setup import generation_steps, prompt_tokens, trainer_rows

#: the micro-batches a shape is traced at: the line through the first two, the curve through all three (1 is no
#: point of either: see the module docstring)
BASES = (2, 3, 4)


def far_check(batch_size: int) -> int:
    """The second micro-batch a line is checked at, beside the one asked for: a kernel that changes path at some
    token count (AWQ's at 1,024) breaks a line past it, so a line answers up to the largest micro-batch it was
    checked at; this one covers what a plan probes on cards up to a few times larger."""
    return max(4 * batch_size, 32)


def applies(setup) -> bool:
    """Whether setup's events can come from its shape's line: training at micro-batch 2 or more (GRPO: 2 units or
    more, unit()), outside TRL's DPO (TRL's fused head runs a pass per 4,096 tokens, so its event count steps every
    2 samples at 1,024 tokens), Liger's fused linear cross-entropy (its chunk count steps with the tokens: Mistral-7B
    LoRA s256 has 24 events fewer at 3 than at 2) and TRL's activation offloading (a free comes a few events later
    at 5 than the line puts it: SmolLM2-135M SFT; benchmarks/results/affine_check.md for both)."""
    if not (setup.mode == "train" and setup.batch_size >= 2 * unit(setup) and setup.trainer != "dpo"
            and not setup.use_liger_kernel and not setup.activation_offloading):
        return False
    end = head_limit(setup)
    return end is None or BASES[1] * unit(setup) <= end and setup.batch_size <= end


def head_limit(setup) -> int | None:
    """The largest micro-batch whose TRL fused head runs one pass (trl/kernels/chunked_logprob.py: a pass per
    TOKEN_CHUNK_SIZE = 4,096 scored tokens, each with its own events), for the trainers that run that head; None for
    the others. A line runs within one pass: past it the events change (memplan.runtime.trl.scored counts them)."""
    if setup.trainer not in ("sft", "grpo"):
        return None
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    except ImportError:  # no TRL: its runs are not traced either
        return 0
    step = unit(setup)

    def tokens(b: int) -> int:
        rows = trainer_rows(at(setup, b), setup.attn_impl or "sdpa")
        return scored(rows.batch_size, rows.seq_len, prompt_tokens(setup), rows.padded)
    per = tokens(2 * step) - tokens(step)  # the scored tokens are affine in the micro-batch
    if per <= 0:
        return None
    k = max(0, (TOKEN_CHUNK_SIZE - tokens(step)) // per)
    return (k + 1) * step


def unit(setup) -> int:
    """The step between the micro-batches of a shape: 1, but GRPO's generation batch (micro-batch x steps per
    generation) holds whole groups of num_generations, so its micro-batches come in multiples of this."""
    if setup.trainer != "grpo":
        return 1
    return setup.num_generations // math.gcd(setup.num_generations, generation_steps(setup) * setup.world_size)


def shape_of(setup) -> dict:
    """The Setup's fields that decide its line: all but the micro-batch, accumulation as the trace runs it (GRPO's
    whole: its generation batch is micro-batch x accumulation)."""
    ga = setup.grad_accum if setup.trainer == "grpo" else min(setup.grad_accum, 2)
    return {**setup.to_dict(), "batch_size": None, "grad_accum": ga}


def at(setup, batch_size: int):
    """setup at another micro-batch (its accumulation kept: the shape does not depend on it beyond 1 or more)."""
    return dataclasses.replace(setup, batch_size=batch_size)


@dataclasses.dataclass(frozen=True)
class Line:
    """A shape's events: storage ids numbered by first event, phases, and each size at micro-batch `first` with its
    first and second differences per `step` samples (Newton's forward differences; 0 for frees, curve 0 on a line);
    upto: the largest micro-batch it was checked at (0: not checked yet)."""
    ids: tuple[int, ...]
    phases: tuple[str, ...]
    base: tuple[int, ...]
    slope: tuple[int, ...]
    curve: tuple[int, ...]
    upto: int = 0
    first: int = BASES[0]
    step: int = 1

    def events(self, batch_size: int, checked: bool = True) -> list[tuple] | None:
        """The events at batch_size (StorageTracker.events' 3-tuples); None past the largest micro-batch checked
        (checked=False: any), off the shape's micro-batches, or where a size would not be positive."""
        if (checked and batch_size > self.upto) or batch_size < self.first or (batch_size - self.first) % self.step:
            return None
        k = (batch_size - self.first) // self.step
        bend = k * (k - 1) // 2
        sizes = [b + k * s + bend * c for b, s, c in zip(self.base, self.slope, self.curve)]
        if any(n <= 0 and b > 0 for n, b in zip(sizes, self.base)):
            return None
        return list(zip(self.ids, sizes, self.phases))


def _numbered(events) -> tuple[list[int], list[int], list[str]]:
    """events' storages renumbered by birth (the replay needs identity only; a free of a storage never born, which
    the replay skips, is -1), sizes, phases; each run of frees within a phase in id order (which storage goes first
    does not change the allocator's state after the run: freed blocks merge with free neighbours either way, and
    Python frees the garbage of one moment in no fixed order); the frees after the last birth left out (no peak
    moves there, and how much of the model a process's first trace frees at its end varies: SmolLM2-135M TRL SFT
    offloaded, 274 frees more in a process's first trace than in its second)."""
    last = max((i for i, (_, n, _) in enumerate(events) if n), default=-1)
    ids: dict = {}
    out: list[tuple[int, int, str]] = []
    run: list[tuple[int, int, str]] = []
    for serial, n, phase in events[:last + 1]:
        if run and (n or phase != run[0][2]):
            out += sorted(run)
            run = []
        if n:
            out.append((ids.setdefault(serial, len(ids)), n, phase))
        else:
            run.append((ids.get(serial, -1), 0, phase))
    out += sorted(run)
    return [e[0] for e in out], [e[1] for e in out], [e[2] for e in out]


def line_through(*runs, first: int = BASES[0], step: int = 1) -> Line | None:
    """The line through the events traced at `first` and `first + step` (two runs), or the curve through those and
    `first + 2 step` (three runs); None where they are not the same run (storages, order, phases or which events
    free)."""
    numbered = [_numbered(run) for run in runs]
    ids, phases = numbered[0][0], numbered[0][2]
    if any(n[0] != ids or n[2] != phases for n in numbered[1:]):
        return None
    sizes = [n[1] for n in numbered]
    if any((a == 0) != (b == 0) for other in sizes[1:] for a, b in zip(sizes[0], other)):
        return None
    slope = tuple(b - a for a, b in zip(sizes[0], sizes[1]))
    curve = tuple(c - 2 * b + a for a, b, c in zip(*sizes)) if len(sizes) == 3 else (0,) * len(ids)
    return Line(tuple(ids), tuple(phases), tuple(sizes[0]), slope, curve, first=first, step=step)


def fit(trace, batch_size: int, runs: dict[int, list] | None = None, step: int = 1,
        limit: int | None = None) -> Line | None:
    """The shape's line or curve (module docstring), checked at batch_size (at the next micro-batch past the bases
    it was made from where batch_size is one of them) and at far_check(batch_size); None where neither holds.
    trace(b) -> the events at micro-batch b, each traced once here into `runs` (micro-batch -> events). step: the
    shape's micro-batches are its multiples (unit()); the bases are BASES of them. limit: the far check's largest
    micro-batch (head_limit())."""
    runs = {} if runs is None else runs

    def at_(b: int) -> list:
        if b not in runs:
            runs[b] = trace(b)
        return runs[b]
    bases = tuple(b * step for b in BASES)
    far = -(-far_check(batch_size) // step) * step
    if limit is not None:
        far = min(far, limit)
    for used in (bases[:2], bases):
        line = line_through(*(at_(b) for b in used), first=used[0], step=step)
        if line is None:
            return None  # not the same run: no curve either
        checks = (batch_size if batch_size not in used else max(used) + step, far)
        if all(holds(line, b, at_(b)) for b in checks):
            return dataclasses.replace(line, upto=max(checks))
    return None


def holds(line: Line, batch_size: int, traced) -> bool:
    """Whether the events traced at batch_size are the line's, event by event (checked or not)."""
    made = line.events(batch_size, checked=False)
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
            "slope": _pack(line.slope), "curve": _pack(line.curve),
            "phases": _pack(names.index(p) for p in line.phases), "upto": line.upto, "first": line.first,
            "step": line.step}


def from_json(data) -> Line | None | bool:
    """The cached line; None for a shape recorded as not affine; False for an entry that is not one of ours."""
    try:
        if data.get("affine") is False:
            return None
        names = data["phase_names"]
        line = Line(_unpack(data["ids"]), tuple(names[i] for i in _unpack(data["phases"])), _unpack(data["base"]),
                    _unpack(data["slope"]), _unpack(data["curve"]), int(data["upto"]), int(data["first"]),
                    int(data["step"]))
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, zlib.error):
        return False
    if not len(line.ids) == len(line.phases) == len(line.base) == len(line.slope) == len(line.curve):
        return False
    return line
