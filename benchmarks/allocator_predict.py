"""Predictions made before the GPU measures: the allocator replay's allocated peak (whole blocks, as
torch.cuda.max_memory_allocated counts them), its requested bytes (the tensors', torch's requested_bytes.all.peak) and
its reserved peak, beside the closed-form estimate, for every setup of a sweep that no GPU has run yet. The file is
committed before the sweep runs; `report` then sets each prediction against the row the GPU wrote.

    python benchmarks/allocator_predict.py predict benchmarks/sweeps/gpu-unsplit-*.yaml   # allocator_predictions.csv
    python benchmarks/allocator_predict.py report                                        # allocator_predictions.md

Each setup is replayed uncapped under the transformers installed here (the row records it); the sweep's rows run
side by side under memory-fraction caps that leave each run room (benchmarks/gpu_pool.py), and `report` flags a row
whose cap made the allocator free its cache (alloc_retries > 0), where the blocks may differ."""
from __future__ import annotations

import datetime
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from allocator_replay import _rel, describe  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "allocator_predictions.csv"
REPORT = RESULTS.with_suffix(".md")
FIELDS = ["key", "model", "setup", "transformers", "replay_allocated_bytes", "replay_requested_bytes",
          "replay_reserved_bytes", "estimate_allocated_bytes", "estimate_reserved_bytes", "predicted_at", "commit"]


def predict(sweeps: list[str]) -> None:
    import csv

    import transformers

    from memplan.errors import BadInput
    from memplan.estimator.breakdown import estimate
    from memplan.fileio import append_csv_row_atomic
    from memplan.replay.need import replay_allocator
    from memplan.measure.sweep import load_sweep
    done = {r["key"] for r in csv.DictReader(open(RESULTS))} if RESULTS.exists() else set()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    for sweep in sweeps:
        jobs, _, steps = load_sweep(sweep)
        for job in jobs:
            key = job.key("cuda")
            if key in done or job.setup.mode != "train" or job.emulate:
                continue
            try:
                got = replay_allocator(job.model, job.setup, None, steps)
            except BadInput as e:  # the setup does not suit the model: validate refuses it too
                print(f"skip {job.model} {describe(job.setup)}: {e}")
                continue
            est = estimate(job.model, job.setup)
            row = dict(key=key, model=job.model, setup=describe(job.setup), transformers=transformers.__version__,
                       replay_allocated_bytes=got.peak_allocated, replay_requested_bytes=got.peak_requested,
                       replay_reserved_bytes=got.peak_reserved, estimate_allocated_bytes=est.peak_allocated_bytes,
                       estimate_reserved_bytes=est.peak_reserved_bytes,
                       predicted_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       commit=commit)
            append_csv_row_atomic(RESULTS, FIELDS, row)
            done.add(key)
            unsplit = got.peak_allocated - got.peak_requested
            print(f"{job.model} {row['setup']}: allocated {got.peak_allocated / 2**30:.3f} GiB, unsplit "
                  f"{100 * unsplit / got.peak_allocated:.2f}%, closed form "
                  f"{_rel(est.peak_allocated_bytes, got.peak_allocated, 2)} of it", flush=True)


def report() -> int:
    import csv

    from memplan.fileio import write_text_atomic
    from memplan.measure.rows import measured_files, read_rows
    preds = {r["key"]: r for r in csv.DictReader(open(RESULTS))}
    measured = {}
    for path in measured_files([str(ROOT / "data" / "measured")]):
        for r in read_rows(path):
            p = preds.get(r["key"])
            if p and r["status"] == "ok" and r["transformers"] == p["transformers"]:
                measured[r["key"]] = r
    lines = ["# Allocator predictions against the GPU", "",
             "`python benchmarks/allocator_predict.py` (predictions in allocator_predictions.csv, each made and "
             "committed before a GPU ran the setup). Allocated: torch.cuda.max_memory_allocated (whole blocks); "
             "requested: torch's requested_bytes.all.peak (the tensors' bytes); the closed form counts tensors.", "",
             "| model | setup | predicted at | GPU allocated GiB | replay | closed form | unsplit (replay) | "
             "GPU requested vs replay | cap freed cache |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    errs = []
    for key, p in sorted(preds.items(), key=lambda kv: (kv[1]["model"], kv[1]["setup"])):
        r = measured.get(key)
        unsplit = int(p["replay_allocated_bytes"]) - int(p["replay_requested_bytes"])
        share = f"{100 * unsplit / int(p['replay_allocated_bytes']):.2f}%"
        if r is None:
            lines.append(f"| {p['model']} | {p['setup']} | {p['predicted_at'][:10]} | not yet measured | | | {share} | | |")
            continue
        meas = int(r["measured_allocated_bytes"])
        errs.append((int(p["replay_allocated_bytes"]) - meas) / meas)
        req = _rel(p["replay_requested_bytes"], r["measured_requested_bytes"], 2) if r.get("measured_requested_bytes") else "-"
        lines.append(f"| {p['model']} | {p['setup']} | {p['predicted_at'][:10]} | {meas / 2**30:.3f} | "
                     f"{_rel(p['replay_allocated_bytes'], meas, 2)} | {_rel(p['estimate_allocated_bytes'], meas, 2)} | "
                     f"{share} | {req} | {'yes' if (r.get('alloc_retries') or '0') != '0' else 'no'} |")
    if errs:
        lines[4:4] = [f"Measured {len(errs)} of {len(preds)}: the replay's allocated |error| median "
                      f"{100 * statistics.median(abs(e) for e in errs):.2f}%, worst {100 * min(errs):+.2f}% / "
                      f"{100 * max(errs):+.2f}%.", ""]
    write_text_atomic(REPORT, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["predict"]:
        predict(sys.argv[2:])
    else:
        sys.exit(report())
