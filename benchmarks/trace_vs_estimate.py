"""Estimate vs tracer (real transformers/peft/torch step on fake tensors) over a matrix of setups.

    python benchmarks/trace_vs_estimate.py [--quick] [--catalog-only] [--tag TAG]

Writes benchmarks/results/trace_vs_estimate.{md,csv}: per row the traced and estimated peak allocated bytes,
the relative error, the peak phases and the bytes per category. The tracer is the ground truth; a row off by more
than 3% points at an effect the estimator misses (docs/MODEL.md lists the ones found this way).

Run under another transformers release (a venv with it installed and memplan installed without dependencies) with
`--catalog-only --tag transformers-X.Y.Z`: the estimate models the installed release (memplan.libs), rows the
libraries cannot trace there are listed with the failure, and the results go to trace_vs_estimate_TAG.{md,csv}.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ROOT / "benchmarks" / "shapes"
#: (model, setup fields, layers) rows - layers None traces the whole model; the rows marked quick are the CI subset
#: (tests/integration/test_trace.py reads the same file)
MATRIX_FILE = ROOT / "benchmarks" / "matrices" / "trace_vs_estimate.yaml"


def load_matrix(path: Path = MATRIX_FILE) -> tuple[list[tuple[str, dict, int | None]], list[int]]:
    """(rows, indices of the quick rows); a model path ending in .json is relative to the repository root."""
    import yaml

    rows = yaml.safe_load(path.read_text())
    matrix = [(str(ROOT / r["model"]) if r["model"].endswith(".json") else r["model"], r["setup"], r.get("layers"))
              for r in rows]
    return matrix, [i for i, r in enumerate(rows) if r.get("quick")]


MATRIX, QUICK = load_matrix()


def run_row(model: str, fields: dict, layers):
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup
    from memplan.tracer.training import compare, trace

    setup = Setup(**fields)
    t0 = time.perf_counter()
    result = trace(model, setup, layers=layers)
    seconds = time.perf_counter() - t0
    c = compare(result, estimate(model, setup))
    return setup, result, c, seconds


def label(fields: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the CI subset only")
    ap.add_argument("--catalog-only", action="store_true", help="leave out the family shapes (benchmarks/shapes)")
    ap.add_argument("--tag", default="", help="results go to trace_vs_estimate_TAG.{md,csv}")
    ap.add_argument("--match", default="", help="only the rows whose setup label matches this regular expression "
                    "(trainer=, quant=(gptq|awq|fp8))")
    args = ap.parse_args(argv)
    from memplan.errors import MemplanError
    rows = [MATRIX[i] for i in QUICK] if args.quick else MATRIX
    if args.catalog_only:
        rows = [r for r in rows if not r[0].startswith(str(SHAPES))]
    if args.match:
        import re
        rows = [r for r in rows if re.search(args.match, label(r[1]))]
    out, failed = [], []
    for i, (model, fields, layers) in enumerate(rows):
        try:
            setup, r, c, sec = run_row(model, fields, layers)
        except MemplanError as e:  # this release cannot run the setup, or not on fake tensors (TraceFailed)
            failed.append((model.replace(f"{ROOT}/", ""), label(fields), " ".join(str(e).split())[:240]))
            print(f"[{i + 1}/{len(rows)}] {model} {label(fields)}: not run", flush=True)
            continue
        out.append({"model": model.replace(f"{ROOT}/", ""), "setup": label(fields), "layers": layers or "all",
                    "traced_mib": c["traced_peak_tensor_bytes"] / 2**20,
                    "estimated_mib": c["estimated_peak_tensor_bytes"] / 2**20,
                    "rel_error_pct": 100 * c["rel_error"], "traced_phase": c["traced_peak_phase"],
                    "estimated_phase": c["estimated_peak_phase"], "seconds": sec,
                    **{f"traced_{k}_mib": v / 2**20 for k, v in c["traced_components"].items()},
                    **{f"estimated_{k}_mib": v / 2**20 for k, v in c["estimated_components"].items()}})
        print(f"[{i + 1}/{len(rows)}] {model} {label(fields)}: {out[-1]['rel_error_pct']:+.2f}% ({sec:.1f} s)",
              flush=True)
    errs = [abs(r["rel_error_pct"]) for r in out]
    import torch
    import transformers

    import memplan
    head = (f"{datetime.date.today()} · memplan {memplan.__version__} · torch {torch.__version__} · transformers "
            f"{transformers.__version__} · {len(out)} setups · median |error| {statistics.median(errs):.2f}% · "
            f"max |error| {max(errs):.2f}% · within 3%: {sum(e <= 3 for e in errs)}/{len(errs)}")
    lines = ["# Estimate vs trace (peak allocated)", "", head, "",
             "| model | setup | layers | traced MiB | estimated MiB | error | traced phase | estimated phase |",
             "|---|---|---|---:|---:|---:|---|---|"]
    for r in sorted(out, key=lambda r: -abs(r["rel_error_pct"])):
        lines.append(f"| {r['model']} | {r['setup']} | {r['layers']} | {r['traced_mib']:,.1f} | "
                     f"{r['estimated_mib']:,.1f} | {r['rel_error_pct']:+.2f}% | {r['traced_phase']} | "
                     f"{r['estimated_phase']} |")
    if failed:
        lines += ["", f"## Not run ({len(failed)}): the release does not support the setup, or its step fails on fake tensors", "",
                  "| model | setup | failure |", "|---|---|---|"]
        lines += [f"| {m} | {f} | {why} |" for m, f, why in failed]
    from memplan.fileio import write_text_atomic
    res = ROOT / "benchmarks" / "results"
    suffix = ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    write_text_atomic(res / f"trace_vs_estimate{suffix}.md", "\n".join(lines) + "\n")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(out[0]))
    w.writeheader()
    w.writerows({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()} for r in out)
    write_text_atomic(res / f"trace_vs_estimate{suffix}.csv", buf.getvalue())
    print(head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
