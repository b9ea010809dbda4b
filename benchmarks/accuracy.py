"""The accuracy table: the current estimator against every GPU measurement in data/measured/.

Each ok row measured on CUDA (memplan validate, one process per setup) is estimated again with the transformers
release it ran under (memplan.libs.assume, as `memplan check` does); rows that hit OOM are left out (their peak is the cap, not the setup's); rows run beside others under a memory-fraction cap that did
not bind are kept (device totals are only measured when a setup had the GPU to itself). Per technique group and overall: rows, median and p95
|relative error| of peak allocated, peak reserved and device total (nvidia-smi), and the worst under-prediction of
peak allocated (the error that causes OOMs). Rows marked gate=no are included (the table is the honest one). Training
rows also compare each phase's peak (forward, backward, optimizer step). Rows the allocator replay covers
(benchmarks/results/allocator_replay.csv, `python benchmarks/allocator_replay.py`) add the replay's own errors and the
bytes of the blocks it handed out unsplit at its allocated peak: torch.cuda.max_memory_allocated counts whole blocks
while the closed form counts tensors.

    python benchmarks/accuracy.py [--data data/measured] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUANTITIES = (("allocated", "peak_allocated_bytes"), ("reserved", "peak_reserved_bytes"),
              ("device", "device_total_bytes"))
REPLAY = ROOT / "benchmarks" / "results" / "allocator_replay.csv"


def group_of(setup) -> str:
    """The technique group a row is reported under."""
    if setup.mode == "infer":
        return "inference" + (f" {setup.quant}" if setup.quant else "")
    if setup.technique == "full":
        return f"full {setup.precision}"
    if setup.technique == "lora" and setup.quant:
        return f"lora on {setup.quant}"
    return setup.technique


def measured_errors(data: Path) -> list[dict]:
    """One dict per usable GPU row: model, label, group, gated, and the relative error of each quantity."""
    from memplan.measure.gate import row_label, estimate_row
    from memplan.measure.rows import int_or_none, measured_files, read_rows, setup_from_row

    out = []
    replays = replay_results()
    for path in measured_files([str(data)]):
        for row in read_rows(path):
            if row.get("device", "cuda") != "cuda" or row.get("status") != "ok":
                continue
            setup = setup_from_row(row)
            est = estimate_row(row)
            rep = replays.get((path.name, row.get("key")))
            rec = {"model": row["model"], "label": row_label(row), "group": group_of(setup), "file": path.name,
                   "trainer": setup.trainer, "replay_status": rep and rep["replay_status"],
                   "gated": (row.get("gate") or "yes").lower() not in ("no", "false", "0")}
            for name, attr in QUANTITIES:
                measured = int_or_none(row.get(f"measured_{name}_bytes"))
                rec[name] = (getattr(est, attr) - measured) / measured if measured else None
            requested = int_or_none(row.get("measured_requested_bytes"))
            rec["requested"] = (est.peak_allocated_bytes - requested) / requested if requested else None
            allocated = int_or_none(row.get("measured_allocated_bytes"))
            rec["measured_unsplit"] = (allocated - requested) / allocated if requested and allocated else None
            rec.update(phase_errors(row, est) if setup.mode == "train" else {})
            rec.update(replay_errors(row, rep if rep and rep["replay_status"] == "ok" else None))  # ran to the end
            out.append(rec)
    return out


def replay_results() -> dict[tuple[str, str], dict]:
    """The allocator replay's results by (measured file, row key), its verdict under the row's cap ("ok" or "oom")
    in replay_status; a row missing here has not been replayed."""
    import csv
    if not REPLAY.exists():
        return {}
    return {(r["file"], r["key"]): r for r in csv.DictReader(open(REPLAY))}


def replay_errors(row: dict, rep: dict | None) -> dict:
    """The replay's relative error on allocated and reserved, and `unsplit`: the bytes of blocks handed out whole
    to smaller requests at its allocated peak (allocated - requested), as a share of the measured allocated."""
    from memplan.measure.rows import int_or_none
    allocated, reserved = (int_or_none(row.get(f"measured_{q}_bytes")) for q in ("allocated", "reserved"))
    if rep is None or not allocated or not rep.get("replay_requested_bytes"):
        return {"replay_allocated": None, "replay_reserved": None, "unsplit": None}
    import json
    blocks, requested = int(rep["replay_allocated_bytes"]), int(rep["replay_requested_bytes"])
    out = {"replay_allocated": (blocks - allocated) / allocated,
           "replay_reserved": (int(rep["replay_reserved_bytes"]) - reserved) / reserved if reserved else None,
           "unsplit": (blocks - requested) / allocated}
    measured = json.loads(row.get("phase_allocated") or "{}")
    pa, pq = (json.loads(rep.get(f"replay_phase_{q}") or "{}") for q in ("allocated", "requested"))
    for name in PHASES:  # each phase's unsplit blocks at the replay's peak of that phase
        if measured.get(name) and name in pa and name in pq:
            out[f"phase_{name}_unsplit"] = (pa[name] - pq[name]) / measured[name]
    return out


PHASES = ("forward", "backward", "optimizer")


def phase_errors(row: dict, est) -> dict:
    """Relative error of each training phase's peak allocated (the validator's max_memory_allocated per phase, column
    phase_allocated) against the estimate's: forward, the larger of its end and its in-block moment; backward, the
    largest of the estimate's backward phases; the optimizer step. A phase that is not the step's peak still checks
    the terms alive in it (the per-phase rows found
    CUDA's math kernel for fp32 grouped K/V and BART's cache-less training forward, both hidden at the peak)."""
    import json

    measured = json.loads(row.get("phase_allocated") or "{}")
    back = max((v for k, v in est.phases.items() if not k.startswith("forward") and k != "optimizer_step"),
               default=None)
    fwd = max((v for k, v in est.phases.items() if k.startswith("forward")), default=None)
    predicted = {"forward": fwd, "backward": back, "optimizer": est.phases.get("optimizer_step")}
    return {f"phase_{name}": (predicted[name] - measured[name]) / measured[name]
            if measured.get(name) and predicted[name] else None for name in PHASES}


def _p95(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(0.95 * (len(v) - 1)))]


def summarise(rows: list[dict], name: str) -> dict:
    out = {"group": name, "rows": len(rows)}
    for q, _ in QUANTITIES:
        errs = [abs(r[q]) for r in rows if r[q] is not None]
        out[f"{q}_median"] = statistics.median(errs) if errs else None
        out[f"{q}_p95"] = _p95(errs) if errs else None
    under = min((r["allocated"] for r in rows if r["allocated"] is not None), default=None)
    out["worst_under"] = under if under is not None and under < 0 else 0.0
    out["within_3"] = sum(1 for r in rows if r["allocated"] is not None and abs(r["allocated"]) <= 0.03)
    return out


def table(rows: list[dict]) -> list[dict]:
    groups = sorted({r["group"] for r in rows})
    return [summarise([r for r in rows if r["group"] == g], g) for g in groups] + [summarise(rows, "all")]


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(summary: list[dict], rows: list[dict], gpus: str) -> str:
    lines = [f"# Estimator accuracy on GPU measurements ({datetime.date.today().isoformat()})", "",
             f"Source: data/measured/ ({gpus}); `python benchmarks/accuracy.py`. |error| = |predicted - measured| / "
             "measured; under-prediction = predicted below measured (negative).", "",
             "| technique | rows | allocated median | allocated p95 | reserved median | reserved p95 | device median | "
             "device p95 | worst under-prediction (allocated) | within 3% |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        name = f"**{s['group']}**" if s["group"] == "all" else s["group"]
        lines.append(f"| {name} | {s['rows']} | {_pct(s['allocated_median'])} | {_pct(s['allocated_p95'])} | "
                     f"{_pct(s['reserved_median'])} | {_pct(s['reserved_p95'])} | {_pct(s['device_median'])} | "
                     f"{_pct(s['device_p95'])} | {_pct(s['worst_under'])} | {s['within_3']} |")
    lines += ["", "Per-phase peaks of the training rows (each phase's measured max allocated against the estimate's "
              "phase; the backward against the largest backward phase):", "",
              "| phase | rows | median | p95 | worst under-prediction | worst over-prediction |",
              "|---|---:|---:|---:|---:|---:|"]
    for name in PHASES:
        errs = [r[f"phase_{name}"] for r in rows if r.get(f"phase_{name}") is not None]
        if errs:
            lines.append(f"| {name} | {_spread(errs)} |")
    for name in PHASES:  # the same phases with the replay's unsplit blocks of that phase added to the closed form
        errs = [r[f"phase_{name}"] + r[f"phase_{name}_unsplit"] for r in rows
                if r.get(f"phase_{name}") is not None and r.get(f"phase_{name}_unsplit") is not None]
        if errs:
            lines.append(f"| {name} + unsplit blocks (replayed rows) | {_spread(errs)} |")
    lines += replay_section(rows) + requested_section(rows)
    worst = sorted(rows, key=lambda r: -abs(r["allocated"] or 0))[:15]
    lines += ["", "Largest allocated errors (unsplit: the replay's bytes of blocks handed out whole at its allocated "
              "peak, a share of the measured; '-' where the row is not replayed):", "",
              "| model | setup | allocated | unsplit | reserved | device | gated |",
              "|---|---|---:|---:|---:|---:|---|"]
    for r in worst:
        lines.append(f"| {r['model']} | {r['label']} | {_pct(r['allocated'])} | {_pct(r.get('unsplit'))} | "
                     f"{_pct(r['reserved'])} | {_pct(r['device'])} | {'yes' if r['gated'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _spread(errs: list[float]) -> str:
    a = [abs(e) for e in errs]
    return (f"{len(errs)} | {_pct(statistics.median(a))} | {_pct(_p95(a))} | {_pct(min(min(errs), 0.0))} | "
            f"{_pct(max(max(errs), 0.0))}")


def replay_section(rows: list[dict]) -> list[str]:
    """The allocator replay's errors, the unsplit blocks it finds, and the closed form with those blocks added."""
    rep = [r for r in rows if r.get("unsplit") is not None]
    if not rep:
        return []
    top = max(rep, key=lambda r: r["unsplit"])
    lines = ["", "The allocator replay (memplan/runtime/allocator.py over the whole model's traced events, under the row's "
             "cap; training and inference rows in benchmarks/results/allocator_replay.csv). Allocated as torch counts it: whole "
             "blocks; a large-pool block whose remainder would be 1 MiB or less goes whole to a smaller request. "
             "The closed form counts tensors; its last line adds the replay's unsplit bytes to it:", "",
             "| quantity | rows | median | p95 | worst under-prediction | worst over-prediction |",
             "|---|---:|---:|---:|---:|---:|",
             f"| replay allocated | {_spread([r['replay_allocated'] for r in rep])} |",
             f"| replay reserved | {_spread([r['replay_reserved'] for r in rep if r['replay_reserved'] is not None])} |",
             f"| closed-form allocated (these rows) | {_spread([r['allocated'] for r in rep])} |",
             f"| closed-form allocated + unsplit blocks | "
             f"{_spread([r['allocated'] + r['unsplit'] for r in rep])} |",
             "", f"Unsplit blocks at the replay's allocated peak: median {_pct(statistics.median(r['unsplit'] for r in rep))}"
             f" of the measured peak, largest {_pct(top['unsplit'])} ({top['model']} {top['label']})."]
    return lines


def requested_section(rows: list[dict]) -> list[str]:
    """Rows that measured torch's requested_bytes (the tensors' bytes, the closed form's own quantity)."""
    got = [r for r in rows if r.get("requested") is not None]
    if not got:
        return []
    return ["", "Rows that measured requested_bytes.all.peak (the tensors' own bytes: what the closed form counts):", "",
            "| quantity | rows | median | p95 | worst under-prediction | worst over-prediction |",
            "|---|---:|---:|---:|---:|---:|",
            f"| closed form vs requested | {_spread([r['requested'] for r in got])} |", "",
            f"Unsplit blocks measured ((allocated - requested) / allocated): median "
            f"{_pct(statistics.median(r['measured_unsplit'] for r in got))}, largest "
            f"{_pct(max(r['measured_unsplit'] for r in got))}."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "measured"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    rows = measured_errors(Path(a.data))
    if not rows:
        print("no GPU measurements found", file=sys.stderr)
        return 1
    import pandas as pd

    from memplan.fileio import write_text_atomic
    from memplan.measure.rows import measured_files, read_rows
    gpus = sorted({r.get("gpu", "") for p in measured_files([a.data]) for r in read_rows(p)
                   if r.get("gpu") and r.get("device", "cuda") == "cuda"})
    summary = table(rows)
    out = Path(a.out)
    write_text_atomic(out / "accuracy.md", markdown(summary, rows, ", ".join(gpus)))
    write_text_atomic(out / "accuracy.csv", pd.DataFrame(rows).to_csv(index=False))
    print(markdown(summary, rows, ", ".join(gpus)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
