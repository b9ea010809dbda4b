"""Is a setup's allocation run affine (or quadratic) in its micro-batch? The claim memplan.replay.affine rests on,
checked on the planner check's setups and a spread of the tracer matrix's: events traced at micro-batches 2 and 3
give a line, with 4 a curve; the events traced at CHECKS are compared with them event by event, and the allocator
replay's need from the line (or curve) with the need from the trace.

    python benchmarks/affine_check.py run [REGEX]   # appends results/affine_check.csv (resumable; REGEX over labels)
    python benchmarks/affine_check.py report        # results/affine_check.md

Every trace is the replay's own (memplan.replay.need.traced_events: the whole model, or synthesized from a cut
trace where that is exact), 3 training steps as `memplan validate` runs them."""
from __future__ import annotations

import csv
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results" / "affine_check.csv"
REPORT = ROOT / "benchmarks" / "results" / "affine_check.md"
FIELDS = ["label", "model", "setup", "events", "affine", "check_batches", "events_off", "need_line_bytes",
          "need_traced_bytes", "trace_s", "line_replay_s", "transformers", "torch"]
CHECKS = (5, 11)
#: tracer-matrix rows taken: every STRIDE-th training row outside GRPO/DPO (memplan.replay.affine.applies)
STRIDE = 12
SEQ_LEN = 256  # the matrix rows' sequence length is kept where it is at most this; the line does not depend on it


def setups() -> list[tuple[str, str, dict]]:
    """(label, model, Setup fields) to check: the planner check's training pairs as planned today, then the matrix."""
    import planner_check
    from trace_vs_estimate import MATRIX
    out = []
    for model, card, pinned in planner_check.PAIRS:
        if pinned.get("trainer") in ("dpo", "grpo"):
            continue
        s = planner_check.planned(model, card, pinned).to_dict()
        out.append((f"planner {model} {card}", model, s))
    taken = [(m, f) for m, f, _ in MATRIX
             if f.get("trainer") not in ("dpo", "grpo") and f.get("mode", "train") == "train"]
    for i, (model, fields) in enumerate(taken[::STRIDE]):
        fields = {**fields, "seq_len": min(fields.get("seq_len", SEQ_LEN), SEQ_LEN)}
        out.append((f"matrix {i * STRIDE} {model}", model, fields))
    return out


def check(model: str, fields: dict) -> dict:
    import torch
    import transformers

    from memplan.model.catalog import load_spec, spec_for_task
    from memplan.replay import affine
    from memplan.replay.need import traced_events
    from memplan.runtime.allocator import need_and_replay
    from memplan.setup import Setup

    setup = Setup(**{**fields, "batch_size": 2})
    spec = spec_for_task(load_spec(model), setup.task)
    t0 = time.perf_counter()
    bases = [traced_events(spec, affine.at(setup, b), 3) for b in affine.BASES]
    fits = {"line": affine.line_through(*bases[:2]), "curve": affine.line_through(*bases)}
    checks = {b: traced_events(spec, affine.at(setup, b), 3) for b in CHECKS}
    trace_s = time.perf_counter() - t0

    def off(line, b):
        made = line.events(b) if line else None
        got = list(zip(*affine._numbered(checks[b])))
        return len(got) if made is None else abs(len(made) - len(got)) + sum(x != y for x, y in zip(made, got))
    kind = next((k for k, line in fits.items() if line and not any(off(line, b) for b in CHECKS)), "none")
    shown = fits.get(kind) or fits["line"]
    needs_line, replay_s = [], 0.0
    for b in CHECKS:
        made = shown.events(b) if shown else None
        if made is not None:
            t1 = time.perf_counter()
            needs_line.append(need_and_replay(made)[0])
            replay_s = max(replay_s, time.perf_counter() - t1)
    return {"model": model, "setup": json.dumps(fields, sort_keys=True), "events": len(bases[0]), "affine": kind,
            "check_batches": " ".join(map(str, CHECKS)),
            "events_off": " ".join(str(off(shown, b)) for b in CHECKS),
            "need_line_bytes": " ".join(map(str, needs_line)),
            "need_traced_bytes": " ".join(str(need_and_replay(checks[b])[0]) for b in CHECKS),
            "trace_s": f"{trace_s:.1f}", "line_replay_s": f"{replay_s:.2f}",
            "transformers": transformers.__version__, "torch": torch.__version__}


def run(only: str | None) -> None:
    import re
    done = set()
    if RESULTS.exists():
        done = {r["label"] for r in csv.DictReader(RESULTS.open())}
    for label, model, fields in setups():
        if label in done or (only and not re.search(only, label)):
            continue
        try:
            row = {"label": label, **check(model, fields)}
        except Exception as e:  # one setup the tracer cannot run does not stop the others; its row says why
            row = {"label": label, "model": model, "setup": json.dumps(fields, sort_keys=True),
                   "affine": f"error: {type(e).__name__}: {str(e)[:200]}"}
        new = not RESULTS.exists()
        with RESULTS.open("a", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        print(label, row.get("affine"), row.get("events_off"), row.get("trace_s"), flush=True)


def report() -> int:
    from memplan.fileio import write_text_atomic
    rows = list(csv.DictReader(RESULTS.open()))
    lines = ["# Are a setup's allocation events affine in the micro-batch? (memplan.replay.affine)", "",
             "Events traced at micro-batches 2 and 3 give a line, with 4 a curve (a size quadratic in the "
             "micro-batch); "
             "the events traced at " + " and ".join(map(str, CHECKS)) + " are compared with them event by event "
             "(storage, size, phase; a run of frees in id order), and the replay's need from the line or curve that "
             "holds with the need from the trace (`python benchmarks/affine_check.py`, 3 steps as validate runs them, "
             "2 CPU cores; traces: the seconds of all five).", "",
             "| setup | events | holds | events off at " + "/".join(map(str, CHECKS)) +
             " | need, line = traced | traces (s) | replay from the line (s) |", "|---|---:|---|---|---|---:|---:|"]
    kinds: dict[str, int] = {}
    equal = 0
    for r in rows:
        same = r["need_line_bytes"] != "" and r["need_line_bytes"] == r["need_traced_bytes"]
        kinds[r["affine"]] = kinds.get(r["affine"], 0) + 1
        equal += same and r["affine"] in ("line", "curve")
        held = r["affine"] in ("line", "curve")
        lines.append(f"| {r['label']} `{r['setup']}` | {r['events']} | {r['affine']} | {r['events_off']} | "
                     f"{('yes' if same else 'no') if held else '-'} | {r['trace_s']} | {r['line_replay_s']} |")
    times = [float(r["line_replay_s"]) for r in rows if r["affine"] in ("line", "curve")]
    lines += ["", f"{len(rows)} setups: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) +
              f"; the replay's need from the line or curve equal to the traced need at every check on {equal}" +
              (f"; the replay from a cached line took {statistics.median(times):.2f} s median, "
               f"{max(times):.2f} s at most" if times else "") + ".",
              f"Versions: transformers {rows[0]['transformers']}, torch {rows[0]['torch']}." if rows else "", "",
              "Where neither holds (read from the traces, 2026-11-28): LoRA on AWQ at 256 tokens per sample - "
              "gptqmodel's AwqGEMMLinear runs a split-k GEMM with an fp32 [8, M, n] buffer up to 1,024 tokens and "
              "dequantizes the weight above (2 to 4 samples below, 5 and 11 above); Liger's fused linear "
              "cross-entropy, whose chunk count steps with the tokens; TRL's activation offloading, where one free "
              "comes a few events later at 5 than at 2 and 3. The last two are left out by "
              "memplan.replay.affine.applies (traced per micro-batch from the start); the AWQ shapes are caught by "
              "the check and traced per micro-batch."]
    write_text_atomic(REPORT, "\n".join(lines) + "\n")
    print("\n".join(lines[-2:]))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(sys.argv[2] if len(sys.argv) > 2 else None)
    elif sys.argv[1:2] == ["report"]:
        sys.exit(report())
    else:
        sys.exit(__doc__)
