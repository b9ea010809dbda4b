"""The runs memplan.replay.synth builds its events from: a training trace of the model cut to a few blocks, and the
full-depth model's optimizer steps on fake tensors, each with its events tagged by step and block segment."""
from __future__ import annotations

import collections
import dataclasses

from memplan.runtime.tracker import StorageTracker


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
    """(parameter/buffer name -> (stack, block, name) | None, trainable names in order, stack depths, block kinds,
    parameter then buffer names in the order _traced_run tags them)."""
    from memplan.runtime.tracker import block_kind, block_stacks
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
    from memplan.runtime.steps import build_model, cut_config
    from memplan.tracer.training import run
    cut = cut_config(d, layers)
    tracker = SegTracker()
    run(spec, setup, cut, layers, steps, True, tracker=tracker)
    blocks, trainable, depth, kinds, names = layout(build_model(spec, setup, layers, cut))
    return Run(tracker.seg_events, tracker.step_grads(trainable), blocks, depth, kinds,
               dict(zip(tracker.weight_order, names)))


def optimizer_run(spec, setup, d: dict, layers: int | None, steps: int) -> Run:
    """The model at full depth (or cut to `layers`) on fake tensors: its weights, then per step gradients set by
    hand (phase "backward"), the optimizer's step and zero_grad, as the traced loop runs them."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.runtime.emulate.cuda import cuda_like
    from memplan.runtime.steps import build_model, cut_config, make_optimizer, materialize
    from memplan.runtime.tracker import dispatch_mode

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
        opt = make_optimizer(setup, params, standin_tracker=tracker)
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
