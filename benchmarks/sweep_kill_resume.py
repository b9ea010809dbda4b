"""Kill a real `memplan validate --sweep` at random moments, SIGKILL to the sweep or to its measuring child, then
resume it; repeat. Every round must end with exactly the expected rows (one per key, all ok, complete lines), no
temporary file beside the CSV, and no measuring child left running.

    python benchmarks/sweep_kill_resume.py [--rounds 20] [--seed 41]

Writes benchmarks/results/sweep_kill_resume.md.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: a 2-block Llama (hidden 64): each CPU run takes about a second, most of it the process start
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
BATCHES = (1, 2, 3)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _runners() -> list[int]:
    """Processes measuring one setup (`python -m memplan.measure.runner`) that are not zombies."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if b"memplan.measure.runner" in cmd and state != "Z":
            out.append(int(proc.name))
    return out


def one_round(rng: random.Random, work: Path, cmd: list[str], out: Path) -> list[str]:
    """Start the sweep, kill the sweep or its child at a random moment, check, resume to the end, check."""
    problems = []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(0.5, 6.0))
    target = rng.choice(["sweep", "child"])
    if target == "child" and _children(proc.pid):
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
        proc.wait(timeout=120)
    else:
        target = "sweep"
        proc.kill()
        proc.wait()
        time.sleep(0.5)  # the kernel's death signal to the child is immediate; its reaping is not
        if _runners():
            problems.append(f"measuring child left running after the sweep was killed: {_runners()}")
    subprocess.run(cmd, capture_output=True, timeout=600)
    rows = list(csv.DictReader(io.StringIO(out.read_text()))) if out.exists() else []
    keys = [r["key"] for r in rows]
    if sorted(int(r["batch_size"]) for r in rows) != list(BATCHES) or len(set(keys)) != len(keys):
        problems.append(f"after the resume ({target} killed): rows {[(r['batch_size'], r['status']) for r in rows]}")
    if any(r["status"] != "ok" for r in rows):
        problems.append(f"after the resume ({target} killed): statuses {[r['status'] for r in rows]}")
    if not out.read_text().endswith("\n"):
        problems.append("the CSV ends in a half line")
    left = [p.name for p in work.glob("*.tmp")]
    if left:
        problems.append(f"temporary files left: {left}")
    return [f"{target}: {p}" for p in problems] if problems else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sweep_kill_resume.md"))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    failures: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.rounds):
            work = Path(d) / f"round{i}"
            work.mkdir()
            (work / "config.json").write_text(json.dumps(TINY))
            (work / "sweep.yaml").write_text(f"models: ['{work / 'config.json'}']\nbase: {{seq_len: 16}}\n"
                                             f"matrix: {{batch_size: {list(BATCHES)}}}\n")
            out = work / "rows.csv"
            cmd = [sys.executable, "-m", "memplan", "validate", "--sweep", str(work / "sweep.yaml"), "--out",
                   str(out), "--device", "cpu"]
            found = one_round(rng, work, cmd, out)
            failures += [f"round {i}: {f}" for f in found]
            print(f"round {i}: {'ok' if not found else '; '.join(found)}", flush=True)
    import datetime

    from memplan.fileio import write_text_atomic
    lines = ["# Sweep kill and resume", "", f"{datetime.date.today()} · `python benchmarks/sweep_kill_resume.py "
             f"--rounds {args.rounds} --seed {args.seed}` · {time.perf_counter() - t0:.0f} s", "",
             f"{args.rounds} rounds of a 3-row CPU sweep, SIGKILL to the sweep or to its measuring child at a random "
             f"moment, then resumed: {args.rounds - len({f.split(':')[0] for f in failures})} of {args.rounds} "
             "ended with exactly the expected rows, no temporary file and no measuring child left running.", ""]
    lines += [f"- {f}" for f in failures]
    write_text_atomic(Path(args.out), "\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
