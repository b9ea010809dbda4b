"""A replay of PyTorch's CUDA caching allocator over the tracer's allocation events: the segments it would reserve,
and whether a step fits under a memory cap (torch.cuda.set_per_process_memory_fraction), where the estimate's
closed-form need (peak allocated + a fresh block for the largest tensor, memplan.planner.budget) is a bound.

The policy is c10/cuda/CUDACachingAllocator.cpp's defaults (PyTorch 2.x; no max_split_size_mb, no expandable
segments, no garbage-collection threshold), on one stream:
- a request is rounded up to 512 B (kMinBlockSize); up to 1 MiB (kSmallSize) it comes from the small pool, else
  from the large pool;
- the pool's best fit serves it: the smallest free block at least as large (ties: the lower address); the block is
  split when what remains is >= 512 B (small pool) or > 1 MiB (large pool), the request taking the front;
- with no fit a segment is reserved (cudaMalloc): 2 MiB (kSmallBuffer) for small requests, 20 MiB (kLargeBuffer)
  below 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- a segment that would pass the cap is refused; the allocator then frees every cached segment holding no live
  block (release_cached_blocks: split segments stay) and retries once; a second refusal is the OOM;
- a freed block merges with free neighbours of its segment (try_merge_blocks); segments stay reserved (cached)
  until such a release or empty_cache.

Events come from memplan.runtime.tracker.StorageTracker.events: (serial, bytes, phase) when a storage is born,
(serial, 0, phase) when it dies. The tracer sees storages as ops return them: an op's internal workspace and the
cuBLAS workspace are not in them (replay adds the latter where CUDA allocates it: cuda_workspaces)."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from memplan.gpus import cublas_workspace_bytes

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    """The block size a request gets (CUDACachingAllocator round_size, no roundup_power2_divisions)."""
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_size(n: int) -> int:
    """The cudaMalloc a request without a cached fit makes (get_allocation_size)."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    addr: int
    size: int
    segment: int
    small: bool
    free: bool = True
    prev: "_Block | None" = None
    next: "_Block | None" = None
    requested: int = 0  # the rounded request a live block serves (its size, unless the allocator left it unsplit)


@dataclass
class Replay:
    """What the replay found. reserved/allocated: peaks over the run after the build (as validate's meter resets
    them there); allocated counts whole blocks, as torch.cuda.max_memory_allocated does (a large-pool block whose
    remainder would be <= 1 MiB is handed out unsplit), requested the requests they serve (rounded to 512 B: the
    tensor bytes the closed-form estimate counts); phase_reserved/phase_allocated/phase_requested: those peaks per
    phase, each from what is live as the phase starts (validate's meter resets the peaks at each phase);
    oom: the phase whose request found no room under the cap ('' when the run fits); oom_request: its size."""
    peak_reserved: int = 0
    peak_allocated: int = 0
    peak_requested: int = 0
    phase_reserved: dict[str, int] = field(default_factory=dict)
    phase_allocated: dict[str, int] = field(default_factory=dict)
    phase_requested: dict[str, int] = field(default_factory=dict)
    oom: str = ""
    oom_request: int = 0
    retries: int = 0
    segments: list[tuple[str, int]] = field(default_factory=list)  # (phase, bytes) of each cudaMalloc, in order
    run_reserved: int = 0  # the reserved peak over the whole run, the build included


class CachingAllocator:
    """The allocator's state: reserved segments, their blocks, and a best-fit index of free blocks per pool."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.reserved = 0
        self.allocated = 0
        self.requested = 0
        self.max_reserved = 0  # over the whole run, the build included
        self.retries = 0
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}  # small? -> (size, addr, b)
        self._segments: dict[int, _Block] = {}  # segment id -> its first block
        self._ids = itertools.count()
        self._next_addr = 0
        self.segment_log: list[int] = []  # the size of each segment reserved, in order

    def malloc(self, nbytes: int) -> _Block | None:
        """The block serving a request of `nbytes`, or None when the cap leaves no room (the OOM)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))  # best fit: the smallest free block, then the lowest address
        if i < len(pool):
            block = pool.pop(i)[2]
        else:  # a new segment, used at once (never indexed as free)
            block = self._reserve(size, small)
            if block is None:
                self.retries += 1
                self.release_cached()
                block = self._reserve(size, small)
                if block is None:
                    return None
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, block.segment, small, True, block, block.next)
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, size
            bisect.insort(pool, (remaining, rest.addr, rest))
        block.free = False
        block.requested = size
        self.allocated += block.size
        self.requested += size
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        self.allocated -= block.size
        self.requested -= block.requested
        pool = self._free[block.small]
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:  # try_merge_blocks, with the block before
            _unindex(pool, prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:  # and after
            _unindex(pool, nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        bisect.insort(pool, (block.size, block.addr, block))

    def release_cached(self) -> None:
        """Free every segment that is one free block (release_cached_blocks; also what empty_cache does)."""
        for seg, first in list(self._segments.items()):
            if first.free and first.next is None:
                _unindex(self._free[first.small], first)
                self.reserved -= first.size
                del self._segments[seg]

    def _reserve(self, size: int, small: bool) -> _Block | None:
        n = segment_size(size)
        if self.limit is not None and self.reserved + n > self.limit:
            return None
        seg = next(self._ids)
        block = _Block(self._next_addr, n, seg, small)
        self._next_addr += n
        self._segments[seg] = block
        self.reserved += n
        self.max_reserved = max(self.max_reserved, self.reserved)
        self.segment_log.append(n)
        return block


def _unindex(pool: list, block: _Block) -> None:
    """Take a free block out of its pool's best-fit index (sorted by size, then address)."""
    i = bisect.bisect_left(pool, (block.size, block.addr))
    if i < len(pool) and pool[i][2] is block:
        del pool[i]


def replay(events, limit: int | None = None, workspaces: dict[str, int] | None = None) -> Replay:
    """Replay `events` (StorageTracker.events) through a CachingAllocator capped at `limit` bytes of reserved memory.
    The cached blocks of the build are released when the first phase after 'setup' starts (validate's meter calls
    empty_cache there). workspaces: phase -> bytes allocated for good at that phase's first event (the cuBLAS
    workspace of the handle that phase's matmuls create: forward's thread, then autograd's in backward)."""
    alloc = CachingAllocator(limit)
    out = Replay()
    live: dict[int, _Block] = {}
    pending = dict(workspaces or {})
    started = False
    log = alloc.segment_log
    peaks = (out.phase_reserved, out.phase_allocated, out.phase_requested)
    current = None
    res = alo = req = 0  # the current phase's peaks, kept in locals (the loop runs once per storage event)
    malloc, free = alloc.malloc, alloc.free
    for serial, nbytes, phase in events:
        if phase != current and (started or phase not in ("setup", "between")):
            if not started:  # the meter's empty_cache after the build
                alloc.release_cached()
                started = True
            if current is not None:  # the meter's reset: the new phase's peaks start from what is live
                _keep(peaks, current, res, alo, req)
            current = phase
            res, alo, req = alloc.reserved, alloc.allocated, alloc.requested
        if not nbytes:
            block = live.pop(serial, None)
            if block is not None:
                free(block)
            continue  # a free sets no peak
        logged = len(log)
        if pending and phase in pending:
            workspace = pending.pop(phase)
            if malloc(workspace) is None:
                out.oom, out.oom_request = phase, workspace
                break
        block = malloc(nbytes)
        if block is None:
            out.oom, out.oom_request = phase, nbytes
            break
        live[serial] = block
        if started:  # the peaks validate's meter reports: from its reset after the build on
            if len(log) != logged:
                out.segments += [(phase, n) for n in log[logged:]]
            if alloc.reserved > res:
                res = alloc.reserved
            if alloc.allocated > alo:
                alo = alloc.allocated
            if alloc.requested > req:
                req = alloc.requested
    if current is not None:
        _keep(peaks, current, res, alo, req)
    out.peak_reserved, out.peak_allocated, out.peak_requested = (max(d.values(), default=0) for d in peaks)
    out.retries, out.run_reserved = alloc.retries, alloc.max_reserved
    return out


def _keep(peaks, phase: str, *values: int) -> None:
    """A phase's peaks, into the per-phase dicts (a phase met again keeps its larger peak)."""
    for d, value in zip(peaks, values):
        if value > d.get(phase, -1):
            d[phase] = value


def min_limit(events, workspaces: dict[str, int] | None = None, step: int = ROUND_LARGE,
              uncapped: Replay | None = None) -> int:
    """The smallest allocator limit (to `step`) under which replaying `events` does not run out of memory: what a
    card must leave the allocator for the run. Bisection between the live peak and the uncapped reserved peak
    (`uncapped`: the events' replay without a limit, when the caller has it); each probe replays the events (a
    fraction of a second for a 7B model's 3 steps). A probe that fits under a cap never reserved more than its
    run_reserved, so a cap there replays the same run: the upper end drops to it, not just to the probe."""
    free = uncapped or replay(events, None, workspaces)
    lo, hi = free.peak_allocated - 1, free.run_reserved  # lo does not fit (below the live peak); hi fits
    while hi - lo > step:
        mid = (lo + hi) // 2
        probe = replay(events, mid, workspaces)
        lo, hi = (mid, hi) if probe.oom else (lo, probe.run_reserved)
    return hi


def cuda_workspaces(mode: str = "train") -> dict[str, int]:
    """The cuBLAS workspace of each handle, allocated at its first matmul (memplan.gpus.cublas_workspace_bytes):
    training, forward's and autograd's backward thread's; inference, the prefill's (generate() runs on its thread)."""
    per_handle = cublas_workspace_bytes(True) // 2
    return {"forward": per_handle, "backward": per_handle} if mode == "train" else {"prefill": per_handle}


def need_and_replay(events, mode: str = "train"):
    """The smallest allocator limit `events` fit under, and their uncapped replay (cuBLAS workspaces included).

    Returns:
        (limit bytes, Replay)."""
    free = replayed(events, None, mode)
    return min_limit(events, cuda_workspaces(mode), uncapped=free), free


def replayed(events, limit: int | None = None, mode: str = "train"):
    """The caching allocator's replay of a run's events, cuBLAS workspaces included."""
    return replay(events, limit, cuda_workspaces(mode))
