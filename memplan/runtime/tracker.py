"""Storage accounting for the tracer: every storage an op creates is counted (rounded up to 512 B like the CUDA
caching allocator's smallest block, c10/cuda/CUDACachingAllocator.cpp kMinBlockSize) until a weakref callback
reports its release; the peak live bytes per phase, and the bytes per category at the peak.

Segments (for extrapolating a model cut to a few blocks, memplan.tracer.training): where a phase is in the stack of
blocks, set by hooks on the blocks: ("pre",) before the first block the phase processes, ("block", stack, i) inside
block i, ("after", stack) past the stack's last. A segmented tracker also keeps the peak (and its snapshot) of each
segment class: pre/after, and the first, second, penultimate and last block the phase processes (forward: blocks
0, 1, n-2, n-1; backward: n-1, n-2, 1, 0) with the block's kind (block_kind). Each class's peak is linear in the
depth (its block is the same kind of block at the same place, every other block done or not yet), so it
extrapolates from two depths where the phase's peak does not: which segment holds the phase's peak can change with
the depth. The blocks next to the ends stand for the middle ones (a peak linear in the position is largest at an
end, but a stack's blocks can peak in the middle, as frozen blocks under checkpointing do); they differ from the
ends from 3 blocks on only: from fewer, memplan.tracer.training also takes the phase's own peak extrapolated, a
lower bound."""
from __future__ import annotations

import contextlib
import itertools
import weakref
from memplan.model.layout import BLOCK_LISTS

BLOCK = 512
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries")


def round_block(n: int) -> int:
    return -(-n // BLOCK) * BLOCK if n else 0


class StorageTracker:
    """Live storages keyed by their C pointer; serial numbers identify allocations across pointer reuse."""

    def __init__(self, segmented: bool = False, events: bool = False):
        self.live: dict[int, tuple[int, int]] = {}  # key -> (serial, bytes)
        self.serials = itertools.count()
        self.born: dict[int, str] = {}  # serial -> phase allocated in
        self.origin: dict[int, str] = {}  # serial -> the op that allocated it (for --detail and debugging)
        self.op = ""
        self.tags: dict[int, str] = {}  # serial -> category decided by the caller (weights, gradients, ...)
        self.saved: set[int] = set()
        self.excluded: set[int] = set()  # serials outside the allocator (paged optimizer state)
        self.outside = False  # inside paged(): new storages are born excluded
        self.current = 0
        self.phase = "setup"
        self.peak = 0
        self.peak_phase = ""
        self.peak_snapshot: dict[int, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self.segmented = segmented  # keep segment peaks (watch_blocks sets the segment)
        self.segment: tuple = ("pre",)
        self.stack_depth: dict[str, int] = {}  # stack (the blocks' ModuleList path) -> number of blocks
        self.block_kinds: dict[tuple[str, int], tuple] = {}  # (stack, i) -> (parameters, trainable parameters)
        self.segment_peaks: dict[tuple[str, tuple], tuple[int, dict[int, int]]] = {}  # (phase, class) -> peak, live
        # events=True: (serial, bytes, phase) at each birth, (serial, 0, phase) at each death (runtime.allocator);
        # the storage's own bytes, which the allocator replay rounds (a size stays affine in the micro-batch:
        # memplan.replay.affine)
        self.events: list[tuple[int, int, str]] | None = [] if events else None
        self.calls: list[int] | None = None  # a list: where each call of the generating model starts in events

    def serial_of(self, t) -> int | None:
        import torch
        if not isinstance(t, torch.Tensor):
            return None
        st = t.untyped_storage()
        key = st._cdata
        hit = self.live.get(key)
        if hit is not None:
            return hit[0]
        raw = st.nbytes()
        n = round_block(raw)
        if n == 0:
            return None
        serial = next(self.serials)
        self.live[key] = (serial, n)
        self.born[serial] = self.phase
        self.origin[serial] = self.op
        weakref.finalize(st, self._release, key, serial)
        if self.outside:  # born in paged memory (cudaMallocManaged): never in the caching allocator
            self.excluded.add(serial)
            return serial
        if self.events is not None:
            self.events.append((serial, raw, self.phase))
        self.current += n
        self._update()
        return serial

    @contextlib.contextmanager
    def paged(self):
        """Storages allocated inside live outside the allocator from birth (bitsandbytes' paged optimizer state:
        its allocation never passes through the caching allocator, so no peak may count it)."""
        self.outside = True
        try:
            yield
        finally:
            self.outside = False

    def _release(self, key: int, serial: int) -> None:
        hit = self.live.get(key)
        if hit is not None and hit[0] == serial:
            del self.live[key]
            if self.events is not None:
                self.events.append((serial, 0, self.phase))
            if serial not in self.excluded:
                self.current -= hit[1]

    def exclude(self, t) -> None:
        """Count this storage outside the allocator (paged memory)."""
        s = self.serial_of(t)
        if s is not None and s not in self.excluded:
            self.excluded.add(s)
            self.current -= self.live[t.untyped_storage()._cdata][1]
            if self.events is not None:  # out of the caching allocator from here on
                self.events.append((s, 0, self.phase))

    def tag(self, t, category: str) -> None:
        s = self.serial_of(t)
        if s is not None:
            self.tags.setdefault(s, category)

    def _update(self) -> None:
        if self.phase not in ("setup", "between"):  # training phases, or prefill/decode (validate --device cpu)
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.current)
            if self.current > self.peak:
                self.peak = self.current
                self.peak_phase = self.phase
                self.peak_snapshot = {s: n for s, n in self.live.values() if s not in self.excluded}
            if self.segmented:
                for cls in self.segment_classes():
                    key = (self.phase, cls)
                    if self.current > self.segment_peaks.get(key, (-1,))[0]:
                        self.segment_peaks[key] = (self.current, {s: n for s, n in self.live.values()
                                                                  if s not in self.excluded})

    def segment_classes(self) -> tuple[tuple, ...]:
        """The classes of the current segment: itself outside blocks; inside a block, its place in the order the
        phase processes blocks (forward 0..n-1, backward n-1..0) and its kind (block_kinds): ("first" | "second"
        | "penultimate" | "last", stack, kind); second and penultimate only where they are not an end (>= 3 blocks),
        none for the blocks between."""
        if self.segment[0] != "block":
            return (self.segment,)
        _, stack, i = self.segment
        n = self.stack_depth[stack]
        p = n - 1 - i if self.phase == "backward" else i
        kind = self.block_kinds[stack, i]
        if p in (0, n - 1):
            return tuple((name, stack, kind) for name, at in (("first", 0), ("last", n - 1)) if p == at)
        return tuple((name, stack, kind) for name, at in (("second", 1), ("penultimate", n - 2)) if p == at)

    def category(self, serial: int, at_phase: str) -> str:
        if serial in self.tags:
            return self.tags[serial]
        if serial in self.saved or (self.born.get(serial) == "forward" and at_phase != "forward"):
            return "activations"
        return "temporaries"

    def breakdown(self, snapshot: dict[int, int] | None = None, phase: str | None = None) -> dict[str, int]:
        """Bytes per category at the peak (or in `snapshot`, taken in `phase`)."""
        out = dict.fromkeys(CATEGORIES, 0)
        snapshot, phase = (self.peak_snapshot, self.peak_phase) if snapshot is None else (snapshot, phase)
        for serial, n in snapshot.items():
            out[self.category(serial, phase)] += n
        return out

    def excluded_bytes(self) -> int:
        return sum(n for s, n in self.live.values() if s in self.excluded)


def dispatch_mode(tracker: StorageTracker, compute=None):
    """The tracking mode; compute(func, args, kwargs), when given, runs each op instead of func itself."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = compute(func, args, kwargs or {}) if compute else func(*args, **(kwargs or {}))
            tracker.op = func.__name__
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    tracker.serial_of(t)
            return out

    return _Mode()


def pack_hooks(tracker: StorageTracker):
    def pack(t):
        s = tracker.serial_of(t)
        if s is not None:
            tracker.saved.add(s)
        return t
    return pack


def block_stacks(model) -> dict[str, list]:
    """The model's stacks of blocks: ModuleList path -> its blocks (GPT-2 transformer.h; T5 encoder.block and
    decoder.block; the outermost list where blocks nest lists, as T5's block.i.layer)."""
    import re

    pattern = re.compile(rf"(?:.*\.)?(?:{BLOCK_LISTS})\.\d+")
    stacks: dict[str, list] = {}
    inside = ()  # prefixes of the blocks found: a list within a block is not a stack
    for name, module in model.named_modules():
        if pattern.fullmatch(name) and not name.startswith(inside):
            stacks.setdefault(name.rsplit(".", 1)[0], []).append(module)
            inside += (f"{name}.",)
    return stacks


def block_kind(block) -> tuple[int, int]:
    """A block's kind: its parameter count and trainable parameter count (freeze's trainable blocks and T5's first
    block, which holds the position bias, are of their own kind)."""
    params = list(block.parameters())
    return sum(q.numel() for q in params), sum(q.numel() for q in params if q.requires_grad)


def watch_blocks(model, tracker: StorageTracker) -> None:
    """Hooks that keep tracker.segment: forward hooks in every pass through the blocks (the forward, TRL's
    reference forward, generation; not checkpointing's recompute, which runs in backward), and in backward,
    gradient hooks on each block's output (its backward starts) and on the first block's input (the stack's
    backward is done)."""
    import torch

    def first_tensor(x):
        x = x[0] if isinstance(x, (tuple, list)) and x else x
        return x if isinstance(x, torch.Tensor) and x.requires_grad else None

    def enter(segment):
        def hook(_grad):
            tracker.segment = segment
        return hook

    for stack, blocks in block_stacks(model).items():
        tracker.stack_depth[stack] = len(blocks)
        for i, block in enumerate(blocks):
            tracker.block_kinds[stack, i] = block_kind(block)

            def pre(_module, args, kwargs, i=i, stack=stack):
                if tracker.phase != "backward":
                    tracker.segment = ("block", stack, i)
                    x = first_tensor(args) if args else first_tensor(kwargs.get("hidden_states"))
                    if i == 0 and x is not None:
                        x.register_hook(enter(("after", stack)))

            def post(_module, _args, output, i=i, stack=stack, last=len(blocks) - 1):
                if tracker.phase != "backward":
                    tracker.segment = ("after", stack) if i == last else ("block", stack, i)
                    y = first_tensor(output)
                    if y is not None:
                        y.register_hook(enter(("block", stack, i)))

            block.register_forward_pre_hook(pre, with_kwargs=True)
            block.register_forward_hook(post)
