"""The CUDA caching allocator's own event trace of validate's steps, beside the replay's (memplan/runtime/allocator.py).

On the GPU machine, for each row key or setup given, run what `memplan validate` runs (build on the GPU, empty the
cache, 3 training steps) with torch.cuda.memory._record_memory_history on, and keep each event's action and size
with the phase it happened in (no stacks). Anywhere, `compare` replays the same setup from a CPU trace and prints
where the two first disagree about reserving a segment.

    python benchmarks/gpu_alloc_trace.py record OUTDIR MODEL key=value ...   # GPU: OUTDIR/<model>-<setup>.json.gz
    python benchmarks/gpu_alloc_trace.py compare FILE.json.gz                 # CPU: first divergences

cap=BYTES among the pairs runs under that allocator cap (set_per_process_memory_fraction, as the planner check
emulates a card) and compare replays under it: where the replay and the GPU disagree about fitting (Qwen2.5-1.5B
QLoRA b4 s1024 on an RTX 3060's 11.49 GiB: the GPU fitted after one release of its cache, the replay did not).

Why: the replay's reserved peak lands within 0.2% (median) of the GPU's, but some rows sit one [tokens, vocab]
fp32 block below it (gpt2 and bart-large b8 s512: -0.77 GiB; benchmarks/results/allocator_replay.md); the GPU's own
trace says which request reserved the extra segment."""
from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path


def _setup(pairs: list[str]):
    """(Setup, cap bytes or None) from key=value pairs."""
    from memplan.setup import Setup
    fields = {}
    for p in pairs:
        k, v = p.split("=", 1)
        fields[k] = int(v) if v.isdigit() else {"true": True, "false": False}.get(v, v)
    cap = fields.pop("cap", None)
    return Setup(**fields), cap


def record(outdir: str, model: str, pairs: list[str]) -> Path:
    """validate's run of the setup in this process (memplan.measure.runner: the same build, loop and TRL trainer)
    with the allocator's history recorded from the meter's start; the events and phase marks into OUTDIR."""
    import torch

    from memplan.measure.meter import CudaMeter
    from memplan.measure.runner import _measure_cuda
    from memplan.model.catalog import config_dict, load_spec
    spec, (setup, cap) = load_spec(model), _setup(pairs)
    marks: list[tuple[int, str]] = []

    def position() -> int:
        return len(torch.cuda.memory._snapshot()["device_traces"][0])

    class TraceMeter(CudaMeter):
        def start(self) -> None:
            super().start()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None, stacks="python")

        def enter(self, phase: str) -> None:
            super().enter(phase)
            marks.append((position(), phase))
    fraction = cap / torch.cuda.get_device_properties(0).total_memory if cap else None
    meter = TraceMeter(fraction)
    result = _measure_cuda(spec, setup, config_dict(spec), 3, fraction, None, meter=meter)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [(e["action"], e["size"], e["addr"]) for e in snap["device_traces"][0]]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{model}-{'-'.join(pairs)}")  # what the device tool brings back
    out = Path(outdir) / f"{name}.json.gz"
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt") as f:
        json.dump({"model": model, "setup": setup.to_dict(), "marks": marks, "events": events, "cap": cap,
                   "status": result.status, "reserved_peak": meter.reserved_peak, "torch": torch.__version__}, f)
    print(out, len(events), "events;", result.status, "; reserved peak", meter.reserved_peak)
    return out


def compare(path: str) -> None:
    """The segments each side reserved after the build (cudaMalloc sizes, in order, with their phase) side by side,
    and the first place they differ."""
    from memplan.setup import Setup
    from memplan.replay.need import traced_events
    from memplan.runtime.allocator import replayed
    d = json.load(gzip.open(path, "rt"))
    setup = Setup(**{k: v for k, v in d["setup"].items() if v is not None})
    marks = sorted(d["marks"])
    events = list(traced_events(d["model"], setup, 3))  # one trace for the replay and both listings below

    def phase_of(i: int) -> str:
        return next((p for at, p in reversed(marks) if at <= i), "setup")
    gpu = [(phase_of(i), e[1]) for i, e in enumerate(d["events"]) if e[0] == "segment_alloc"]
    r = replayed(events, d.get("cap"), setup.mode)
    print(f"reserved peak: GPU {d['reserved_peak'] / 2**30:.3f} GiB, replay {r.peak_reserved / 2**30:.3f} GiB; segments "
          f"reserved: GPU {len(gpu)}, replay {len(r.segments)}")
    if d.get("cap"):
        print(f"under a cap of {d['cap'] / 2**30:.2f} GiB: GPU {d.get('status')}, replay "
              f"{'oom in ' + r.oom + f' asking {r.oom_request / 2**30:.2f} GiB' if r.oom else 'ok'}; GPU cache "
              f"releases: {sum(e[0] == 'segment_free' for e in d['events'])} segments freed")
    allocation_sizes(d, phase_of, events)
    large_requests(d, phase_of, events)
    first = next((i for i, (a, b) in enumerate(zip(gpu, r.segments)) if a != b), min(len(gpu), len(r.segments)))
    for i in range(max(0, first - 3), min(max(len(gpu), len(r.segments)), first + 12)):
        a = gpu[i] if i < len(gpu) else ("", 0)
        b = r.segments[i] if i < len(r.segments) else ("", 0)
        print(f"{'>' if i == first else ' '} {i:4d}  GPU {a[0]:10s} {a[1] / 2**20:9.1f} MiB   replay {b[0]:10s} "
              f"{b[1] / 2**20:9.1f} MiB")


def allocation_sizes(d: dict, phase_of, events) -> None:
    """Per phase of the first step, the allocation sizes the GPU made more (or fewer) times than the trace: where
    the GPU's extra allocated bytes come from (a CUDA kernel's own buffers, a different dtype)."""
    from collections import Counter

    from memplan.runtime.allocator import round_size
    traced: dict[str, Counter] = {}
    seen_optimizer = False
    for _, n, phase in events:
        seen_optimizer |= phase == "optimizer"
        if n and not seen_optimizer and phase in ("forward", "backward"):
            traced.setdefault(phase, Counter())[round_size(n)] += 1
    gpu: dict[str, Counter] = {}
    seen_optimizer = False
    for i, (action, size, _) in enumerate(d["events"]):
        phase = phase_of(i)
        seen_optimizer |= phase == "optimizer"
        if action == "alloc" and not seen_optimizer and phase in ("forward", "backward"):
            gpu.setdefault(phase, Counter())[size] += 1
    for phase in ("forward", "backward"):
        g, t = gpu.get(phase, Counter()), traced.get(phase, Counter())
        diff = {size: g[size] - t[size] for size in g.keys() | t.keys() if g[size] != t[size]}
        extra = sum(size * k for size, k in diff.items())
        print(f"first step's {phase}: GPU allocated {extra / 2**20:+.1f} MiB more in total than the trace; largest "
              "differences (size x count):")
        for size, k in sorted(diff.items(), key=lambda x: -abs(x[0] * x[1]))[:10]:
            print(f"    {size / 2**20:10.2f} MiB x {k:+d}")


def large_requests(d: dict, phase_of, events, floor: int = 256 << 20) -> None:
    """The first step's allocations and frees of at least `floor` bytes from the loss to the end of backward, GPU
    and trace side by side: whether a [tokens, vocab] block is freed before the next one is asked for (a cached block
    to reuse) on one side and not the other."""
    live: dict[int, int] = {}
    trace = []
    for serial, n, phase in events:
        if phase == "optimizer":
            break
        if n:
            live[serial] = n
        size = n or live.pop(serial, 0)
        if size >= floor and phase in ("forward", "backward"):
            trace.append(("+" if n else "-") + f"{size / 2**20:.0f}")
    gpu = []
    for i, (action, size, _) in enumerate(d["events"]):
        if phase_of(i) == "optimizer":
            break
        if size >= floor and action in ("alloc", "free_completed", "segment_alloc", "segment_free"):
            gpu.append({"alloc": "+", "free_completed": "-", "segment_alloc": "S+", "segment_free": "S-"}[action]
                       + f"{size / 2**20:.0f}")
    print("large requests (MiB, + alloc, - free, S segment) up to the first optimizer step:")
    print("  GPU:   " + " ".join(gpu[-60:]))
    print("  trace: " + " ".join(trace[-60:]))


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        compare(sys.argv[2])
