"""Where did the memory go? The live CUDA allocations at each phase's peak, grouped by the code that made them
(issue 6: model the effects behind the largest errors, never fudge them).

Each case runs `memplan validate`'s own steps (memplan.runtime.steps) in a subprocess with torch's allocator history
recording (torch.cuda.memory._record_memory_history, Python stacks). The trace is replayed: at each phase's peak
the live blocks are summed by site, i.e. the innermost frame in transformers / peft / bitsandbytes / torch.optim /
memplan code, with the innermost frame of all beside it. Allocations made by autograd's C++ engine (backward)
have no Python frame of their own; they are grouped under the frame that called backward().

    python benchmarks/gpu_diagnose.py OUT_DIR CASES.yaml [--parallel N] [--fraction F]

CASES.yaml: a list of {model: ..., <Setup fields>}. Writes OUT_DIR/diagnose.md (tables) and OUT_DIR/diagnose.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_MARK = "@@DIAG@@"
_SITES = ("transformers/", "peft/", "bitsandbytes/", "torch/optim/", "memplan/", "accelerate/")
TOP = 30


def _short(f: dict) -> str:
    name = f.get("filename", "?")
    for cut in ("site-packages/", "dist-packages/", "/work/", "/main/"):
        if cut in name:
            name = name.split(cut, 1)[1]
    return f"{name}:{f.get('line', '?')} {f.get('name', '?')}"


def _site(frames: list[dict]) -> str:
    inner = _short(frames[0]) if frames else "(no Python frame)"
    for f in frames:
        if any(s in f.get("filename", "") for s in _SITES):
            site = _short(f)
            return site if site == inner else f"{site} <- {inner}"
    return inner


def _label(e: dict, stacks: bool) -> str:
    """Where an allocation came from, or (recorded without stacks) its size, the next best clue to the tensor."""
    if stacks:
        return _site(e.get("frames") or [])
    return f"(no stacks) block of {e['size'] / 2**20:,.2f} MiB"


def _replay(trace: list[dict], marks: list[tuple[str, int]], stacks: bool = True) -> dict:
    """Per phase (between marks): the peak live bytes and the live set at that peak, by site."""
    bounds = marks + [("end", len(trace))]
    live: dict[int, tuple[int, str]] = {}
    cur = 0
    out: dict[str, dict] = {}
    for (phase, start), (_, stop) in zip(bounds, bounds[1:]):
        best, best_i = cur, start - 1
        for i in range(start, stop):
            e = trace[i]
            a = e.get("action")
            if a == "alloc":
                live[e["addr"]] = (e["size"], _label(e, stacks))
                cur += e["size"]
                if cur > best:
                    best, best_i = cur, i
            elif a == "free_requested" and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
        out.setdefault(phase, []).append((best, best_i))
    # second pass: the live set at each phase's highest peak
    want = {}
    for phase, peaks in out.items():
        b, i = max(peaks)
        want[i] = phase
    live.clear()
    cur = 0
    result: dict[str, dict] = {}
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = (e["size"], _label(e, stacks))
        elif a == "free_requested" and e["addr"] in live:
            live.pop(e["addr"])
        if i in want:
            by: dict[str, list[int]] = {}
            for size, site in live.values():
                slot = by.setdefault(site, [0, 0])
                slot[0] += size
                slot[1] += 1
            result[want[i]] = {"peak_bytes": sum(v[0] for v in by.values()),
                               "sites": sorted(([k, v[0], v[1]] for k, v in by.items()), key=lambda r: -r[1])}
    if -1 in want:
        result[want[-1]] = {"peak_bytes": 0, "sites": []}
    return result


def run_case(case: dict, fraction: float | None, stacks: bool = True) -> dict:
    """In this process: build, record, run, replay. stacks=False records sizes only (checkpointed T5/BERT runs
    raised SystemError in run_backward while Python stacks were recorded, session 8)."""
    import torch

    from memplan.model.catalog import config_dict, load_spec
    from memplan.setup import Setup
    from memplan.runtime.steps import build_model, inference_loop, make_optimizer, materialize, training_loop
    from memplan.measure.runner import quantize_bnb
    fields = {k: v for k, v in case.items() if k != "model"}
    setup = Setup(**fields)
    spec = load_spec(case["model"])
    torch.cuda.init()
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    if stacks:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    else:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, context=None)
    trace_len = lambda: len(torch.cuda.memory._snapshot()["device_traces"][0])  # noqa: E731
    marks: list[tuple[str, int]] = [("setup", 0)]
    peaks: dict[str, int] = {}
    phase = ["setup"]

    def enter(name: str) -> None:
        if phase[0] not in ("setup", "between"):
            peaks[phase[0]] = max(peaks.get(phase[0], 0), torch.cuda.max_memory_allocated())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        marks.append((name, trace_len()))
        phase[0] = name

    status = "ok"
    model = build_model(spec, setup, None, config_dict(spec), quantizer=quantize_bnb("cuda"), real_kernels=True)
    materialize(model, fake=False, device="cuda")
    try:
        if setup.mode == "train":
            opt = make_optimizer(setup, model.parameters())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            training_loop(model, opt, spec, setup, 2, "cuda", enter)
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            inference_loop(model, spec, setup, "cuda", enter)
        enter("between")
    except torch.OutOfMemoryError as e:
        status = "oom: " + str(e).splitlines()[0][:200]
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0]
    dropped = len(trace) >= 4_000_000
    phases = _replay(trace, marks, stacks)
    return {"case": case, "status": status, "stacks": stacks, "allocator_phase_peaks": peaks, "trace_events": len(trace),
            "trace_truncated": dropped, "phases": phases}


def _child(arg: str) -> None:
    c = json.loads(arg)
    try:
        r = run_case(c["case"], c["fraction"], c.get("stacks", True))
    except Exception as e:  # reported, not raised: one broken case must not stop the others
        import traceback
        r = {"case": c["case"], "status": f"error: {type(e).__name__}: {e}", "tb": traceback.format_exc()[-2000:]}
    print(_MARK + json.dumps(r), flush=True)


def _spawn(case: dict, fraction: float | None, timeout: float, stacks: bool = True) -> dict:
    """One case in a fresh process; a run that fails while recording stacks is run again recording sizes only."""
    arg = json.dumps({"case": case, "fraction": fraction, "stacks": stacks})
    try:
        p = subprocess.run([sys.executable, __file__, "--child", arg], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": case, "status": f"timed out after {timeout} s"}
    for line in p.stdout.splitlines():
        if line.startswith(_MARK):
            r = json.loads(line[len(_MARK):])
            if stacks and r["status"].startswith("error"):
                again = _spawn(case, fraction, timeout, stacks=False)
                again["status"] += f" (sizes only: with stacks the run failed: {r['status'][:200]})"
                return again
            return r
    return {"case": case, "status": f"exited {p.returncode}: {p.stderr[-1500:]}"}


def _estimate(case: dict) -> dict:
    from memplan.estimator.breakdown import estimate
    from memplan.model.catalog import load_spec
    from memplan.setup import Setup
    e = estimate(load_spec(case["model"]), Setup(**{k: v for k, v in case.items() if k != "model"}))
    return {"peak_phase": e.peak_phase, "phase_totals": {k: round(v / 2**30, 3) for k, v in e.phases.items()},
            "components": {k: v for k, v in e.components.items() if v}}


def report(results: list[dict]) -> str:
    g = 2 ** 30
    out = ["# Live CUDA allocations at each phase's peak (benchmarks/gpu_diagnose.py)", ""]
    for r in results:
        c = r["case"]
        out += [f"## {c['model']} " + " ".join(f"{k}={v}" for k, v in c.items() if k != "model"), "",
                f"status {r['status']}; trace events {r.get('trace_events')} (truncated: {r.get('trace_truncated')})"]
        if "tb" in r:
            out += ["```", r["tb"], "```"]
        try:
            est = _estimate(c)
            out += [f"estimate: phases (GiB) {est['phase_totals']}; peak phase {est['peak_phase']}; components (GiB) " +
                    ", ".join(f"{k} {v / g:.3f}" for k, v in est["components"].items())]
        except Exception as e:  # the report still shows the measurement
            out.append(f"estimate failed: {e}")
        for phase, peak in (r.get("allocator_phase_peaks") or {}).items():
            out.append(f"- allocator peak {phase}: {peak / g:.3f} GiB")
        for phase, d in (r.get("phases") or {}).items():
            out += ["", f"### {phase}: {d['peak_bytes'] / g:.3f} GiB live at its peak", "",
                    "| GiB | blocks | site |", "|---:|---:|---|"]
            out += [f"| {b / g:.4f} | {n} | `{s}` |" for s, b, n in d["sites"][:TOP]]
        out.append("")
    return "\n".join(out)


def main() -> None:
    import argparse

    import yaml
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("cases")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=400)
    a = ap.parse_args()
    cases = yaml.safe_load(open(a.cases))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with ThreadPoolExecutor(a.parallel) as ex:  # the files are rewritten as each case ends (a cut-off run keeps them)
        for fut in as_completed([ex.submit(_spawn, c, a.fraction, a.timeout) for c in cases]):
            r = fut.result()
            results.append(r)
            (out / "diagnose.json").write_text(json.dumps(results))
            print(r["case"]["model"], r["status"][:300], {k: round(v / 2**30, 3) for k, v in
                                                           (r.get("allocator_phase_peaks") or {}).items()}, flush=True)
    (out / "diagnose.md").write_text(report(results))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        main()
