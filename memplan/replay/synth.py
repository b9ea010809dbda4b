"""The allocation events of a deep model's training steps without tracing every block (for the caching-allocator
replay, memplan.runtime.allocator): a trace cut to CUT = 5 blocks gives blocks 0, 1 (the first may differ: T5's
holds the position bias), 3, 4 and the template, block 2; the whole run is blocks 0, 1, N - 4 copies of the
template's runs (forward in order, backward in reverse), then 3 and 4 as blocks N - 2 and N - 1. A copy's free of a
neighbour's allocation frees its own neighbour's (the same ordinal in that block's run). Weights, optimizer steps
and zero_grad come from the full-depth model on fake tensors, given gradients by hand (cached per setup: the
micro-batch does not change them), its gradients renamed to the synthesized ones parameter by parameter.

Checked, not assumed: a setup's first synthesis is compared with a trace cut to VERIFY = 7 blocks, event by event
(canonical()); a difference, blocks of different kinds (freeze's trainable blocks, dense-then-MoE stacks), config
layer_types of several kinds, or a model of at most VERIFY blocks, and the caller traces the whole model.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json

from memplan.errors import MemplanError
from memplan.model.catalog import config_dict
from memplan.model.hf import config_from_dict
from memplan.runtime.emulate.cuda import cuda_like
from memplan.runtime.steps import build_model, cut_config, make_optimizer, materialize
from memplan.runtime.tracker import StorageTracker, block_kind, block_stacks, dispatch_mode
from memplan.tracer.training import run_traced

CUT = 5
TEMPLATE = 2
VERIFY = 7
_verified: dict[tuple, bool] = {}
_optimizer_runs: dict[tuple, "Run"] = {}


class _Mismatch(Exception):
    """The cut trace's blocks do not allocate alike."""


def synthesize(cut: Run, opt: Run) -> list[tuple]:
    """The whole model's training events at opt's depth, built from the cut trace's (module docstring).

    Input, cut.events and opt.events (SegTracker.seg_events), are 5-tuples (serial, bytes, phase, step, segment):
    serial an int; bytes > 0 where a storage is born, 0 where it dies; phase "setup", "forward", "backward",
    "optimizer", "zero_grad" or "between"; step the training step, from 0 (SegTracker: a step ends at zero_grad);
    segment ("pre",), ("block", stack, i) or ("after", stack) (StorageTracker.segment).

    Output: opt's setup events (its weights), then per step cut's batch, forward and backward events - its blocks
    0 and 1, one copy of TEMPLATE's run per middle block, its last two blocks - and opt's optimizer and zero_grad
    events, opt's gradients renamed to the synthesized ones.

    Returns:
        3-tuples (serial, bytes, phase), StorageTracker.events' shape, in order; serial: cut's int serial,
        (serial, j) for the copy of a TEMPLATE storage standing for full block j, or ("o", serial) for opt's.

    Raises:
        _Mismatch where the cut's blocks do not allocate alike (events() then falls back to a whole trace)."""
    n, N = cut.depth, opt.depth

    def copies(stack):
        return range(TEMPLATE, N[stack] - (n[stack] - TEMPLATE - 1))

    def full_block(stack, i):  # a kept block of the cut -> its block in the full model
        return i if i < TEMPLATE else N[stack] - (n[stack] - i)

    born = {s: seg for s, nbytes, _, _, seg in cut.events if nbytes}
    runs = collections.defaultdict(list)  # (step, phase, stack, block) -> [(serial, bytes)] allocated there
    for s, nbytes, phase, step, seg in cut.events:
        if nbytes and seg[0] == "block":
            runs[step, phase, seg[1], seg[2]].append((s, nbytes))
    ordinal = {s: (key, k) for key, run in runs.items() for k, (s, _) in enumerate(run)}

    def equivalent(s, block):
        (step, phase, stack, b), k = ordinal[s]
        other, mine = runs[step, phase, stack, block], runs[step, phase, stack, b]
        if len(other) != len(mine) or [x for _, x in other] != [x for _, x in mine]:
            raise _Mismatch(f"blocks {b} and {block} of {stack} allocate differently ({phase}, step {step})")
        return other[k][0]

    opt_weight = {name: s for s, name in opt.weight_names.items()}

    def weight(s, j, cur):
        """The full model's storage of cut weight s (a weight a forward replaces: bnb's bias cast to the input's
        dtype), seen from the run of cut block `cur` (None: outside the blocks) standing for full block j."""
        name = cut.weight_names[s]
        if cut.blocks[name] is not None:
            stack, b, inner = cut.blocks[name]
            name = f"{stack}.{full_block(stack, b) if TEMPLATE not in (cur, b) else j + b - cur}.{inner}"
        if name not in opt_weight:
            raise _Mismatch(f"no weight {name} at full depth")
        return ("o", opt_weight[name])

    def ref(s, j, cur, stack):
        """What a free of cut serial s, in the run of cut block `cur` standing for full block j, frees."""
        if s in cut.weight_names:
            return weight(s, j, cur)
        seg = born.get(s)
        if seg is None or seg[0] != "block" or seg[1] != stack or TEMPLATE not in (cur, seg[2]):
            return s  # outside the stack, or between kept blocks (T5's position bias, freed by the last block)
        if abs(seg[2] - cur) > 1:
            raise _Mismatch(f"block {cur} of {stack} frees an allocation of block {seg[2]}")
        target = j + seg[2] - cur
        if target in copies(stack):
            return (s if seg[2] == TEMPLATE else equivalent(s, TEMPLATE), target)
        kept = target if target < TEMPLATE else n[stack] - (N[stack] - target)
        return s if seg[2] == kept else equivalent(s, kept)

    out = [(("o", s), nbytes, phase) for s, nbytes, phase, _, _ in opt.events if phase == "setup"]
    batch = {s for s, nbytes, phase, _, _ in cut.events
             if nbytes and phase in ("setup", "between") and s not in cut.weight_names}
    per_step = collections.defaultdict(list)
    for e in cut.events:  # every pass through the blocks (TRL's reference forward, GRPO's generation too)
        if e[2] not in ("setup", "between", "optimizer", "zero_grad") or e[0] in batch:
            per_step[e[3]].append(e)
    for step, es in sorted(per_step.items()):
        for (seg, phase), run in itertools.groupby(es, key=lambda e: (e[4], e[2])):
            if seg[0] == "block" and seg[2] == TEMPLATE:  # the template's run: one copy per middle block
                run = list(run)
                for j in reversed(copies(seg[1])) if phase == "backward" else copies(seg[1]):
                    out += [((s, j), nbytes, phase) if nbytes else (ref(s, j, TEMPLATE, seg[1]), 0, phase)
                            for s, nbytes, _, _, _ in run]
                continue
            for s, nbytes, _, _, _ in run:
                if nbytes:
                    out.append((s, nbytes, phase))
                elif seg[0] == "block":
                    out.append((ref(s, full_block(seg[1], seg[2]), seg[2], seg[1]), 0, phase))
                else:  # outside the blocks: a free of a template allocation frees every copy's
                    b, w = born.get(s), cut.blocks.get(cut.weight_names.get(s))
                    if w is not None and w[1] == TEMPLATE:
                        out += [(weight(s, j, TEMPLATE), 0, phase) for j in copies(w[0])]
                    elif s in cut.weight_names:
                        out.append((weight(s, None, None), 0, phase))
                    elif b is not None and b[0] == "block" and b[2] == TEMPLATE:
                        out += [((s, j), 0, phase) for j in copies(b[1])]
                    else:
                        out.append((s, 0, phase))
        full_grads = _full_grads(cut, born, step, copies, full_block)
        if set(opt.grads[step]) - set(full_grads):
            raise _Mismatch(f"no synthesized gradient for {sorted(set(opt.grads[step]) - set(full_grads))[:3]}")
        rename = {s: full_grads[name] for name, s in opt.grads[step].items()}
        out += [(rename.get(s, ("o", s)) if not nbytes else ("o", s), nbytes, phase)
                for s, nbytes, phase, st, _ in opt.events if st == step and phase in ("optimizer", "zero_grad")]
    return out


def _full_grads(cut: Run, born: dict, step: int, copies, full_block) -> dict:
    """{full-depth parameter name: the synthesized serial of its gradient} for one step (born: serial -> the segment
    it was allocated in). A gradient belongs to the run it was allocated in (AccumulateGrad may run in a
    neighbour's): its copies' parameters shift with them."""
    out = {}
    for name, s in cut.grads[step].items():
        where, seg = cut.blocks[name], born.get(s)
        if where is None:
            out[name] = s
            continue
        stack, block, inner = where
        if seg is not None and seg[0] == "block" and seg[1] == stack:
            if seg[2] == TEMPLATE:
                out.update({f"{stack}.{j + block - TEMPLATE}.{inner}": (s, j) for j in copies(stack)})
                continue
            at = full_block(stack, seg[2]) + block - seg[2]
        elif block == TEMPLATE:
            raise _Mismatch(f"the gradient of {name} is allocated outside the blocks")
        else:
            at = full_block(stack, block)
        out[f"{stack}.{at}.{inner}"] = s
    return out


def canonical(events) -> list:
    """Events with serials renumbered by birth, each burst of frees (between two allocations) as a sorted tuple:
    the allocator's state after a burst does not depend on the order of its frees."""
    ids, out, burst = {}, [], []
    for s, nbytes, phase in events:
        if nbytes:
            if burst:
                out.append(tuple(sorted(burst)))
                burst = []
            ids[s] = len(ids)
            out.append((ids[s], nbytes, phase))
        else:
            burst.append((ids.get(s, -1), phase))
    return out + ([tuple(sorted(burst))] if burst else [])


def through_last_step(events) -> list:
    """Events up to the last zero_grad one (what follows is the run's teardown)."""
    last = max(i for i, e in enumerate(events) if e[2] == "zero_grad")
    return list(events[:last + 1])


def _kinds_alike(cut: Run, opt: Run) -> bool:
    """Blocks 1 to 3 of the cut alike; the full model's blocks: the cut's ends, then the template's kind."""
    for stack, N in opt.depth.items():
        n = cut.depth.get(stack)
        if n != CUT or len({cut.kinds[stack, i] for i in (1, 2, 3)}) > 1:
            return False
        want = [cut.kinds[stack, i] for i in (0, 1)] + [cut.kinds[stack, TEMPLATE]] * (N - CUT + 1) + \
            [cut.kinds[stack, i] for i in (3, 4)]
        if [opt.kinds[stack, i] for i in range(N)] != want:
            return False
    return bool(opt.depth)


def events(spec, setup, steps: int) -> list | None:
    """The whole model's training events (StorageTracker.events form) synthesized from a cut trace, or None where
    synthesis does not apply or its check against a VERIFY-block trace fails (module docstring)."""
    d = config_dict(spec)
    types = getattr(config_from_dict(d), "layer_types", None)
    depths = [n for n in (spec.arch.num_encoder_layers, spec.arch.num_decoder_layers) if n]
    # the setup whatever its micro-batch (as text: micro-batch 1 is no valid GRPO Setup when it must hold groups)
    shape = {**setup.to_dict(), "batch_size": 1, "grad_accum": min(setup.grad_accum, 2)}
    key = (spec.model_id, json.dumps(shape, sort_keys=True, default=str), steps)
    if (not depths or min(depths) <= VERIFY or (types and len(set(types)) > 1) or _verified.get(key) is False
            or any(p[-1:].isdigit() for p in spec.arch.media_parts)):
        return None
    try:  # any failure here falls back to the whole-model trace, which reports its own
        if key not in _optimizer_runs:
            _optimizer_runs[key] = optimizer_run(spec, setup, d, None, steps)
        cut = cut_run(spec, setup, d, CUT, steps)
        if key not in _verified:
            whole = cut_run(spec, setup, d, VERIFY, steps)
            _verified[key] = _kinds_alike(cut, _optimizer_runs[key]) and canonical(through_last_step(
                synthesize(cut, optimizer_run(spec, setup, d, VERIFY, steps)))) == canonical(
                through_last_step([e[:3] for e in whole.events]))
        return synthesize(cut, _optimizer_runs[key]) if _verified[key] else None
    except (_Mismatch, MemplanError, RuntimeError, ValueError, KeyError, IndexError):
        _verified[key] = False
        return None


# ------------------------------------------------------------------------------------------- the runs
# A training trace of the model cut to a few blocks, and the full-depth model's optimizer steps on fake tensors,
# each with its events tagged by step and block segment.


class SegTracker(StorageTracker):
    """Events with the step and the block segment they happen in; gradient serials per (step, micro-step)."""

    def __init__(self):
        self.step = self.micro = 0
        super().__init__(segmented=True, events=True)
        self.seg_events: list[tuple] = []  # (serial, bytes, phase, step, segment)
        self.grads: dict[tuple[int, int], list] = collections.defaultdict(list)
        self.weight_order: list = []  # serials of the parameters, then the buffers, as _traced_run tags them
        tracker = self

        class Events(list):
            def append(self, e):
                super().append(e)
                tracker.seg_events.append((*e, tracker.step, tracker.segment))

        self.events = Events()

    def __setattr__(self, name, value):  # steps end at zero_grad (the next batch is made in "between")
        if name == "phase" and value != getattr(self, "phase", value):
            self.step += value == "between" and self.phase == "zero_grad"
            self.micro += value == "forward"
        super().__setattr__(name, value)

    def tag(self, t, category):
        super().tag(t, category)
        if category in ("gradients", "weights"):
            (self.grads[self.step, self.micro] if category == "gradients" else self.weight_order).append(
                self.serial_of(t))

    def step_grads(self, names: list[str]) -> list[dict]:
        """Per step: {trainable parameter name: its gradient's serial} after the step's last micro-step."""
        last = {step: dict(zip(names, serials)) for (step, _), serials in sorted(self.grads.items())}
        return [last[s] for s in sorted(last)]


@dataclasses.dataclass
class Run:
    events: list  # SegTracker.seg_events
    grads: list  # per step: {param name: gradient serial}
    blocks: dict  # parameter or buffer name -> (stack, block, name inside the block), None outside the blocks
    depth: dict  # stack -> blocks
    kinds: dict  # (stack, block) -> (parameters, trainable parameters)
    weight_names: dict  # serial of each parameter and buffer -> its name


def layout(model):
    """Where each parameter and buffer of `model` sits in its stacks of blocks, and what the runs need of them.

    Returns:
        (parameter/buffer name -> (stack, block, name) | None, trainable names in order, stack depths, block kinds,
        parameter then buffer names in the order _traced_run tags them)."""
    where, kinds = {}, {}
    stacks = block_stacks(model)
    for stack, blocks in stacks.items():
        for i, block in enumerate(blocks):
            kinds[stack, i] = block_kind(block)
            for name, t in list(block.named_parameters()) + list(block.named_buffers()):
                where[id(t)] = (stack, i, name)
    named = list(model.named_parameters()) + list(model.named_buffers())
    return ({n: where.get(id(t)) for n, t in named}, [n for n, t in named if getattr(t, "requires_grad", False)],
            {s: len(b) for s, b in stacks.items()}, kinds, [n for n, _ in named])


def cut_run(spec, setup, d: dict, layers: int, steps: int) -> Run:
    """The traced training steps of the model cut to `layers` blocks."""
    cut = cut_config(d, layers)
    tracker = SegTracker()
    run_traced(spec, setup, cut, layers, steps, True, tracker=tracker)
    blocks, trainable, depth, kinds, names = layout(build_model(spec, setup, layers, cut))
    return Run(tracker.seg_events, tracker.step_grads(trainable), blocks, depth, kinds,
               dict(zip(tracker.weight_order, names)))


def optimizer_run(spec, setup, d: dict, layers: int | None, steps: int) -> Run:
    """The model at full depth (or cut to `layers`) on fake tensors: its weights, then per step gradients set by
    hand (phase "backward"), the optimizer's step and zero_grad, as the traced loop runs them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    d = cut_config(d, layers) if layers else d
    model = build_model(spec, setup, layers, d)
    blocks, trainable, depth, kinds, names = layout(model)
    tracker = SegTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), dispatch_mode(tracker), \
            cuda_like(setup.padded, spec.arch.kind == "seq2seq"):
        materialize(model, True)
        for t in list(model.parameters()) + list(model.buffers()):
            tracker.tag(t, "weights")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(setup, params, standin_tracker=tracker, model=model)
        for _ in range(steps):
            tracker.phase = "forward"
            tracker.phase = "backward"
            for p in params:
                p.grad = torch.empty(p.shape, dtype=p.dtype)
                tracker.tag(p.grad, "gradients")
            tracker.phase = "optimizer"
            opt.step()
            tracker.phase = "zero_grad"
            opt.zero_grad(set_to_none=True)
            tracker.phase = "between"
        return Run(list(tracker.seg_events), tracker.step_grads(trainable), blocks, depth, kinds,
                   dict(zip(tracker.weight_order, names)))
