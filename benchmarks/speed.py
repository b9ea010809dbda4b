"""Speed targets: `memplan fit` of a catalog model < 1 s wall in a fresh process; estimates per second (>= 1000
for the planner); import time of the pure core. Writes benchmarks/results/speed.md.

    python benchmarks/speed.py
"""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str], repeat: int = 5) -> float:
    """Median wall seconds of a command run as a fresh process."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def estimates_per_second(model: str = "meta-llama/Llama-2-7b-hf", n: int = 2000) -> float:
    import dataclasses

    from memplan.estimator.breakdown import estimate
    from memplan.model.catalog import load_spec
    from memplan.setup import Setup

    spec = load_spec(model)
    setups = [Setup(technique=t, precision="bf16", batch_size=b, seq_len=512, grad_ckpt=c)
              for t in ("full", "lora", "qlora") for b in (1, 2, 4, 8) for c in (False, True)]
    t = time.perf_counter()
    for i in range(n):
        s = setups[i % len(setups)]  # the rank varies where there is an adapter (Setup refuses it on full)
        estimate(spec, dataclasses.replace(s, lora_r=8 + i % 3) if s.uses_lora else s)
    return n / (time.perf_counter() - t)


def timed(fn, repeat: int = 5):
    """(median wall seconds, last result) of `repeat` calls: this shared machine's speed varies by tens of
    percent from one call to the next."""
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def plan_rates() -> list[tuple[str, str, str]]:
    """The planner in process: candidate setups estimated per second and wall time per plan (medians of 5)."""
    from memplan.gpus import find_gpu
    from memplan.model.catalog import load_spec
    from memplan.planner.search import plan

    rows = []
    for model, gpu, prefer, pins in (("meta-llama/Llama-2-7b-hf", "RTX 3060", "quality", {}),
                                     ("meta-llama/Llama-2-7b-hf", "RTX 4090", "speed", {}),
                                     ("meta-llama/Llama-2-70b-hf", "RTX 3060", "quality", {"num_gpus": 1}),
                                     ("meta-llama/Llama-2-70b-hf", "A100 80GB", "quality", {"num_gpus": 8})):
        spec = load_spec(model)
        pins = {**pins, "host_memory": "1TiB"}
        plan(spec, find_gpu(gpu), **pins)  # warm caches
        dt, p = timed(lambda: plan(spec, find_gpu(gpu), prefer=prefer, **pins))
        flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in pins.items())
        rows.append((f"`plan {model} --gpu \"{gpu}\" --prefer {prefer}{flags}`: candidate setups estimated per "
                     f"second ({p.evaluated} in {dt:.2f} s, {'fits' if p.fits else 'nothing fits'})",
                     f"{p.evaluated / dt:,.0f} /s", ">= 1,000 /s"))
    spec = load_spec("meta-llama/Llama-2-70b-hf")
    dt, p = timed(lambda: plan(spec, find_gpu("RTX 3060"), host_memory="1TiB"))
    rows.append(("`plan meta-llama/Llama-2-70b-hf --gpu \"RTX 3060\"` (nothing fits one: the fewest GPUs, then "
                 f"their plan: {p.setup.world_size if p.fits else 'none'} GPUs; in process, median of 5)",
                 f"{dt:.2f} s", "-"))
    return rows


def TRACE_CMD(exe: str) -> list[str]:  # noqa: N802
    return [exe, "-m", "memplan", "trace", "meta-llama/Llama-2-7b-hf", "--technique", "qlora", "--precision", "bf16",
            "--double-quant", "--grad-ckpt", "--batch-size", "4", "--seq-len", "1024", "--layers", "2", "--json"]


def replay_plans(exe: str) -> list[tuple[str, str, str]]:
    """`plan --replay` (memplan/planner/refine.py: per micro-batch probed, its training events - synthesized from a 5-block
    trace where memplan.replay.synth applies - replayed through the caching allocator), one run each."""
    rows = []
    for model, flags in (("openai-community/gpt2", ["--gpu", "RTX 3060"]),
                         ("openai-community/gpt2-xl", ["--gpu", "A10", "--technique", "full", "--precision", "bf16",
                                                       "--optimizer", "adafactor", "--grad-ckpt", "--seq-len", "1024",
                                                       "--effective-batch", "512"]),
                         ("meta-llama/Llama-2-7b-hf", ["--gpu", "RTX 3060", "--technique", "qlora"])):
        cmd = [exe, "-m", "memplan", "plan", model, *flags, "--replay", "--json"]
        t = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        dt = time.perf_counter() - t
        probed = len(json.loads(out[out.index("{"):])["replay"]["replayed"])
        shown = " ".join(f'"{x}"' if " " in x else x for x in flags)
        rows.append((f"`memplan plan {model} {shown} --replay` (fresh process, one run; {probed} micro-batches "
                     "replayed)", f"{dt:.0f} s", "< 300 s"))
    return rows


def main() -> int:
    exe = sys.executable
    fit_cmd = [exe, "-m", "memplan", "fit", "meta-llama/Llama-2-7b-hf", "--gpu", "RTX 3060"]
    rows = [
        ("`memplan fit meta-llama/Llama-2-7b-hf --gpu \"RTX 3060\"` (fresh process, median of 5)",
         f"{wall(fit_cmd):.2f} s", "< 1 s"),
        ("`python -c 'import memplan.estimator.breakdown'` (fresh process, median of 5)",
         f"{wall([exe, '-c', 'import memplan.estimator.breakdown']):.2f} s", "-"),
        ("estimates per second, Llama-2-7B, mixed setups (in process)", f"{estimates_per_second():,.0f} /s",
         ">= 1,000 /s"),
        ("`memplan plan meta-llama/Llama-2-7b-hf --gpu \"RTX 3060\"` (fresh process, median of 5)",
         f"{wall([exe, '-m', 'memplan', 'plan', 'meta-llama/Llama-2-7b-hf', '--gpu', 'RTX 3060']):.2f} s", "< 1 s"),
        *plan_rates(),
        ("`memplan trace meta-llama/Llama-2-7b-hf --technique qlora --precision bf16 --double-quant --grad-ckpt "
         "--batch-size 4 --seq-len 1024 --layers 2` (fresh process, median of 3)",
         f"{wall(TRACE_CMD(exe), repeat=3):.1f} s", "< 60 s"),
        *replay_plans(exe),
    ]
    lines = ["# Speed", "", f"{datetime.date.today()} · {platform.processor() or platform.machine()} · "
             f"Python {platform.python_version()}", "", "| what | measured | target |", "|---|---:|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(lines) + "\n"
    from memplan.fileio import write_text_atomic
    write_text_atomic(ROOT / "benchmarks" / "results" / "speed.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
