"""The caching-allocator replay (memplan/runtime/allocator.py) against the GPU: for each measured row, trace the whole
model's steps (training) or its prefill and generate() (inference: memplan/tracer/inference.py) on the CPU, replay them
through the allocator under the row's cap, and compare

  fit / OOM          capped rows (planner check runs: the H100/H200 capped to a card's memory)
  reserved peak      every ok row, beside the closed-form estimate's peak_reserved_bytes

    python benchmarks/allocator_replay.py run data/measured/planner-check.csv ...   # appends results/allocator_replay.csv
    python benchmarks/allocator_replay.py run --skip-trainer grpo FILES...           # GRPO's traces take minutes a row
    python benchmarks/allocator_replay.py estimates                                 # the closed-form columns, anew
    python benchmarks/allocator_replay.py report                                    # results/allocator_replay.md

The trace runs the transformers installed here: rows measured under another release are skipped (run again from
a virtual environment with that release: the results file collects them, keyed by row). No parameter of the replay
was fitted to these rows: the policy is PyTorch's (see memplan/runtime/allocator.py)."""
from __future__ import annotations

import csv
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "allocator_replay.csv"
REPORT = RESULTS.with_suffix(".md")
FIELDS = ["key", "file", "model", "setup", "transformers", "limit_bytes", "measured_status", "replay_status",
          "measured_reserved_bytes", "replay_reserved_bytes", "estimate_reserved_bytes", "measured_allocated_bytes",
          "replay_allocated_bytes", "replay_requested_bytes", "estimate_allocated_bytes", "replay_phase_allocated",
          "replay_phase_requested", "retries", "seconds"]


def describe(s) -> str:
    if s.mode == "infer":
        parts = ["infer", s.precision, f"b{s.batch_size}", f"prompt {s.prompt_len or s.seq_len}",
                 f"new {s.new_tokens}" if s.new_tokens is not None else "", s.attn_impl or "",
                 "padded" if s.padded else ""]
        return " ".join(p for p in parts if p)
    parts = [s.technique, s.precision, s.optimizer, f"b{s.batch_size}", f"s{s.seq_len}", s.attn_impl or "",
             "ckpt" if s.grad_ckpt else "", "padded" if s.padded else ""]
    return " ".join(p for p in parts if p)


def run(files: list[str], skip_trainers: tuple[str, ...] = ()) -> None:
    import transformers

    from memplan.measure import rows as measured
    from memplan.measure.gate import estimate_row
    from memplan.fileio import append_csv_row_atomic
    from memplan.replay.need import replay_allocator
    # a row is its file's: keys name setups, and a setup measured under two releases sits in two files
    stored = list(csv.DictReader(open(RESULTS))) if RESULTS.exists() else []
    done = {(r["file"], r["key"]) for r in stored}
    earlier = _earlier_replays(stored, measured)
    skipped = 0
    for f in files:
        for r in measured.read_rows(f):
            if r["status"] not in ("ok", "oom") or r["num_gpus"] not in ("", "1") or r.get("trainer") in skip_trainers:
                continue
            if (Path(f).name, r["key"]) in done:
                continue
            if r["transformers"] != transformers.__version__:
                skipped += 1
                continue
            s = measured.setup_from_row(r)
            limit = int(r["memory_limit_bytes"]) if r["memory_limit_bytes"] else None
            t = time.time()
            same = earlier.get((r["model"], s, r["transformers"], r["steps"] or "3"))
            if same and s.mode == "train" and (limit is None or limit >= int(same["replay_reserved_bytes"])):
                got = _Stored(same)  # the same events under a cap they never reach: the same replay
            else:
                try:
                    got = replay_allocator(r["model"], s, limit, int(r["steps"] or 3))
                except Exception as e:  # a tracer limit (memplan trace says which): recorded, not fatal
                    print(f"skip {r['model']} {describe(s)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
            est = estimate_row(r)
            row = dict(key=r["key"], file=Path(f).name, model=r["model"], setup=describe(s),
                       transformers=r["transformers"], limit_bytes=limit or "", measured_status=r["status"],
                       replay_status="oom" if got.oom else "ok", measured_reserved_bytes=r["measured_reserved_bytes"],
                       replay_reserved_bytes=got.peak_reserved, estimate_reserved_bytes=est.peak_reserved_bytes,
                       measured_allocated_bytes=r["measured_allocated_bytes"],
                       replay_allocated_bytes=got.peak_allocated, replay_requested_bytes=got.peak_requested,
                       estimate_allocated_bytes=est.peak_allocated_bytes,
                       replay_phase_allocated=json.dumps(got.phase_allocated, sort_keys=True),
                       replay_phase_requested=json.dumps(got.phase_requested, sort_keys=True), retries=got.retries,
                       seconds=round(time.time() - t, 1))
            append_csv_row_atomic(RESULTS, FIELDS, row)
            done.add((Path(f).name, r["key"]))
            print(f"{row['measured_status']:3s} -> {row['replay_status']:3s}  {r['model']} {row['setup']}  "
                  f"reserved {_rel(row['replay_reserved_bytes'], row['measured_reserved_bytes'])}", flush=True)
    if skipped:
        print(f"{skipped} row(s) measured under another transformers than {transformers.__version__}: skipped")


class _Stored:
    """An earlier replay of the same setup, read back as replay_allocator's result."""

    def __init__(self, row: dict):
        self.oom = False
        self.peak_reserved, self.peak_allocated = int(row["replay_reserved_bytes"]), int(row["replay_allocated_bytes"])
        self.peak_requested = int(row["replay_requested_bytes"]) if row.get("replay_requested_bytes") else ""
        self.phase_allocated = json.loads(row["replay_phase_allocated"] or "{}")
        self.phase_requested = json.loads(row.get("replay_phase_requested") or "{}")
        self.retries = int(row["retries"] or 0)


def _earlier_replays(stored: list[dict], measured) -> dict:
    """(model, Setup, transformers, steps) -> an earlier replay of it that fitted without a retry: the trace of a
    setup is deterministic, so a row measured again under another cap (a pooled call's share) replays the same when
    that cap is above the reserved peak (a training run's build reserves less than its steps)."""
    rows = {}
    for path in measured.measured_files([str(ROOT / "data" / "measured")]):
        for r in measured.read_rows(path):
            rows[path.name, r["key"]] = r
    out = {}
    for res in stored:
        r = rows.get((res["file"], res["key"]))
        if r is None or res["replay_status"] != "ok" or (res["retries"] or "0") != "0":
            continue
        try:
            out[r["model"], measured.setup_from_row(r), r["transformers"], r["steps"] or "3"] = res
        except Exception:  # a row this release cannot read back: no reuse
            continue
    return out


def refresh_estimates() -> None:
    """Recompute the closed-form columns of every stored row with today's estimator (each under its row's
    releases and GPU, memplan.measure.gate.estimate_row): the replays stay, the estimate beside them moves with the model."""
    from memplan.measure import rows as measured
    from memplan.measure.gate import estimate_row
    from memplan.fileio import write_text_atomic
    rows = list(csv.DictReader(open(RESULTS)))
    measured_rows = {(Path(f).name, r["key"]): r for f in {r["file"] for r in rows}
                     for r in measured.read_rows(ROOT / "data" / "measured" / f)}
    for row in rows:
        est = estimate_row(measured_rows[row["file"], row["key"]])
        row.update(estimate_allocated_bytes=est.peak_allocated_bytes, estimate_reserved_bytes=est.peak_reserved_bytes)
    buf = io.StringIO()
    w = csv.DictWriter(buf, FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write_text_atomic(RESULTS, buf.getvalue())


def _rel(pred, meas, digits: int = 1) -> str:
    return f"{100 * (int(pred) - int(meas)) / int(meas):+.{digits}f}%" if meas not in ("", "0", 0, None) else "-"


def report() -> int:
    from memplan.fileio import write_text_atomic
    rows = list(csv.DictReader(open(RESULTS)))
    capped = [r for r in rows if r["limit_bytes"]]
    agree = sum(r["measured_status"] == r["replay_status"] for r in capped)
    ok = [r for r in rows if r["measured_status"] == "ok" and r["replay_status"] == "ok" and r["measured_reserved_bytes"]]

    def errs(col: str, subset) -> list[float]:
        return [abs(int(r[col]) - int(r["measured_reserved_bytes"])) / int(r["measured_reserved_bytes"]) for r in subset]

    def stats(values: list[float]) -> str:
        if not values:
            return "- | -"
        values = sorted(values)
        return f"{100 * statistics.median(values):.1f}% | {100 * values[int(0.95 * (len(values) - 1))]:.1f}%"
    lines = ["# Caching-allocator replay vs the GPU", "",
             "`python benchmarks/allocator_replay.py` (memplan/runtime/allocator.py over whole-model traces on the CPU; rows "
             "from data/measured/). No parameter of the replay was fitted to these rows.", "",
             f"Runs under an allocator cap (planner checks: a card's memory; sweeps shared by several runs: each "
             f"run's share): the replay's fit/OOM matches the GPU in **{agree} of {len(capped)}** "
             f"({sum(r['measured_status'] == 'oom' for r in capped)} of them ran out of memory on the GPU; planner "
             f"checks: {sum(r['file'].startswith('planner') for r in capped)}).", ""]
    wrong = [r for r in capped if r["measured_status"] != r["replay_status"]]
    for r in wrong:
        lines.append(f"- differs: {r['model']} {r['setup']} (GPU {r['measured_status']}, replay {r['replay_status']})")
    lines += ["", "Peak reserved of the rows that ran (|error| median | p95):", "",
              "| rows | replay median | replay p95 | closed-form estimate median | estimate p95 |",
              "|---:|---:|---:|---:|---:|",
              f"| {len(ok)} | {stats(errs('replay_reserved_bytes', ok))} | {stats(errs('estimate_reserved_bytes', ok))} |",
              "", "| model | setup | transformers | cap GiB | GPU | replay | reserved GPU GiB | replay | estimate |",
              "|---|---|---|---:|---|---|---:|---:|---:|"]
    g = 2 ** 30
    for r in sorted(rows, key=lambda r: (r["model"], r["setup"])):
        cap = f"{int(r['limit_bytes']) / g:.2f}" if r["limit_bytes"] else "-"
        meas = int(r["measured_reserved_bytes"] or 0)
        lines.append(f"| {r['model']} | {r['setup']} | {r['transformers']} | {cap} | {r['measured_status']} | "
                     f"{r['replay_status']} | {meas / g:.2f} | {_rel(r['replay_reserved_bytes'], meas)} | "
                     f"{_rel(r['estimate_reserved_bytes'], meas)} |")
    write_text_atomic(REPORT, "\n".join(lines) + "\n")
    print("\n".join(lines[:12 + len(wrong)]))
    return 1 if wrong else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        args, skip = sys.argv[2:], ()
        if args[:1] == ["--skip-trainer"]:
            args, skip = args[2:], tuple(args[1].split(","))
        run(args, skip)
    elif sys.argv[1:2] == ["estimates"]:
        refresh_estimates()
    else:
        sys.exit(report())
