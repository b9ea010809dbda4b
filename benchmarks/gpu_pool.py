"""Run many `memplan validate` setups at once on one large GPU (issue 6's sweeps on an 80 GB H100).

Each setup still runs in its own subprocess (memplan.measure.runner.validate), so its allocator peaks (allocated,
reserved) are its own whatever runs beside it. What sharing the GPU changes is handled explicitly:
- every run's allocator is capped (set_per_process_memory_fraction) to 1.5 x its predicted device total, and runs
  are started only while the caps of the runs in flight add up to less than the GPU's memory, so one run cannot
  push another into an OOM;
- NVML's device-level figures (device total, CUDA context) are everyone's memory, so they are not recorded
  (shared_gpu=True); rows say so in their notes. Device totals come from the one-at-a-time rows.
- planner-check pairs (benchmarks/planner_check.py) run with the card's memory less the CUDA context measured
  alone on this GPU as their cap, exactly what `--emulate` sets.

    python benchmarks/gpu_pool.py SECONDS OUT.csv [--workers N] [--planner] SWEEP.yaml...

Stops starting runs after SECONDS; resumable like the sweeps (rows already in OUT.csv are not run again).
"""
from __future__ import annotations

import argparse
import csv
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

HEADROOM = 1.5  # cap = predicted device total x this (a run needing more is an OOM row, checked like any other)


def gpu_total_bytes() -> int:
    """The total that set_per_process_memory_fraction takes a fraction of (the CUDA device's, as memplan.measure.runner
    uses): NVML's total is larger (81,559 vs 81,079 MiB on an H100 80GB HBM3), and fractions of it capped session
    8's first planner runs 0.6% below the intended card (data/measured/planner-check-run1.csv)."""
    import torch
    return int(torch.cuda.get_device_properties(0).total_memory)


def alone_context_bytes() -> int:
    """The CUDA context measured by a run that had the GPU to itself (data/measured/gpu-h100.csv)."""
    for r in csv.DictReader(open(ROOT / "data" / "measured" / "gpu-h100.csv")):
        if r["cuda_context_bytes"] and "shared GPU" not in r["notes"]:
            return int(r["cuda_context_bytes"])
    raise SystemExit("no one-at-a-time row with a CUDA context in data/measured/gpu-h100.csv")


class Pool:
    def __init__(self, out: Path, total: int, workers: int, deadline: float, device: int | None = None):
        # total: the bytes the runs may share; device: the GPU's memory, what a memory fraction is a fraction of
        self.out, self.total, self.workers, self.deadline = out, total, workers, deadline
        self.device = device or total
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.used = 0
        self.running = 0
        self.counts: dict[str, int] = {}

    def measure(self, job, fraction: float, notes: str, out: Path | None = None):
        """Run one job capped to `fraction` of the GPU and append its row (to `out`, default the pool's CSV);
        returns the row's status."""
        from memplan.measure.rows import append_row, make_row
        from memplan.measure.sweep import now_iso
        from memplan.measure.runner import validate
        m = validate(job.model, job.setup, device="cuda", steps=3, memory_fraction=fraction, timeout=400,
                     shared_gpu=True)
        with self.lock:
            append_row(out or self.out, make_row(job.model, job.setup, key=job.key("cuda"), source="memplan validate",
                                          notes=notes, measured_at=now_iso(), **m.row_values()))
            self.counts[m.status] = self.counts.get(m.status, 0) + 1
        print(f"{m.status:5s} {job.model} {job.setup.technique} {job.setup.precision} b{job.setup.batch_size} "
              f"s{job.setup.seq_len} {m.error[:120] if m.error else ''}", flush=True)
        return m.status

    def run(self, tasks: list[tuple[int, object]], first: int = 0) -> None:
        """tasks: (bytes needed, fn). The `first` tasks before the others (the planner pairs: session 33's pool left
        two of them unstarted at its deadline), then largest first; a task starts when its bytes fit beside those in
        flight."""
        pending = tasks[:first] + sorted(tasks[first:], key=lambda t: -t[0])
        threads = []
        with self.cond:
            while pending:
                if time.time() > self.deadline:
                    print(f"deadline: {len(pending)} task(s) not started", flush=True)
                    break
                pick = next((t for t in pending if self.used + t[0] <= self.total and self.running < self.workers),
                            None)
                if pick is None:
                    self.cond.wait(timeout=5)
                    continue
                pending.remove(pick)
                self.used += pick[0]
                self.running += 1
                th = threading.Thread(target=self._go, args=pick, daemon=True)
                th.start()
                threads.append(th)
        for th in threads:
            th.join()

    def _go(self, need: int, fn) -> None:
        try:
            fn()
        except Exception as e:  # a bug in a task must not stop the others
            print(f"task failed: {type(e).__name__}: {e}", flush=True)
        finally:
            with self.cond:
                self.used -= need
                self.running -= 1
                self.cond.notify_all()


def sweep_tasks(pool: Pool, files: list[str]) -> list:
    from memplan.errors import BadInput
    from memplan.estimator.breakdown import estimate
    from memplan.measure.rows import done_keys
    from memplan.model.catalog import load_spec
    from memplan.measure.sweep import load_sweep
    done = done_keys(pool.out)
    tasks = []
    for f in files:
        jobs, _, _ = load_sweep(f)
        for job in jobs:
            if job.key("cuda") in done:
                continue
            try:
                predicted = estimate(load_spec(job.model), job.setup).device_total_bytes
            except BadInput as e:  # a setup the model cannot take: say so, run the others
                print(f"skipped {job.model} {job.setup.to_dict()}: {e}", flush=True)
                continue
            need = min(pool.total, int(predicted * HEADROOM))
            fraction = need / pool.device
            notes = (f"shared GPU ({pool.workers} runs at most at a time); allocator capped to "
                     f"{need / 2**30:.1f} GiB; no NVML figures")
            tasks.append((need, lambda job=job, fraction=fraction, notes=notes: pool.measure(job, fraction, notes)))
    return tasks


def planner_tasks(pool: Pool) -> list:
    """One task per pair: the closed-form planner's batches, then plan --replay's (made on the CPU under this
    transformers), one after the other so that a batch both need runs once (each measure reads the rows so far)."""
    import planner_check
    from memplan.gpus import find_gpu
    from memplan.measure.rows import done_keys
    context = alone_context_bytes()
    replays = planner_check.stored_replay_batches()
    out = planner_check.out_file()  # the installed transformers release's rows
    tasks = []
    for model, card, pinned in planner_check.PAIRS:
        cap = find_gpu(card).memory_bytes - context

        def measure(job, notes, cap=cap, card=card):
            if job.key("cuda") in done_keys(out):
                return next(r["status"] for r in csv.DictReader(open(out)) if r["key"] == job.key("cuda"))
            return pool.measure(job, cap / pool.device, f"emulating {card} (cap = card - CUDA context measured "
                                f"alone, {cap / 2**30:.2f} GiB); shared GPU; {notes}", out)

        def both(model=model, card=card, pinned=pinned, measure=measure, b=replays.get((model, card))):
            planner_check.check_pair(model, card, pinned, measure)
            if b is not None:
                planner_check.check_pair(model, card, pinned, measure, b)
        tasks.append((cap, both))
    return tasks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seconds", type=float)
    ap.add_argument("out")
    ap.add_argument("sweeps", nargs="*")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--planner", action="store_true")
    a = ap.parse_intermixed_args()  # --planner may come before the sweep files
    from memplan.measure.runner import require_cuda
    require_cuda()
    device = gpu_total_bytes()
    pool = Pool(Path(a.out), int(device * 0.92), a.workers, time.time() + a.seconds, device)
    planner = planner_tasks(pool) if a.planner else []
    tasks = planner + sweep_tasks(pool, a.sweeps)
    print(f"{len(tasks)} task(s), {a.workers} at a time, {pool.total / 2**30:.1f} GiB shared", flush=True)
    pool.run(tasks, first=len(planner))
    print("counts:", pool.counts, flush=True)


if __name__ == "__main__":
    main()
