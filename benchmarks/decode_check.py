"""GRPO's generations made from short runs (memplan/replay/decode.py) against whole traces: for each setup, the
events traced_events gives (a completion of 64 tokens made from runs of 8, 9 and 12) beside the whole run's, event
by event (serials renumbered, bursts of frees as sets), and the allocator replay's need and peaks of both.

    python benchmarks/decode_check.py [SHARD/NSHARDS]   # appends results/decode_check.csv (resumable)
    python benchmarks/decode_check.py report            # results/decode_check.md
"""
from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "decode_check.csv"
FIELDS = ["model", "setup", "synthesized", "events", "same_events", "need_bytes", "need_whole_bytes",
          "reserved_bytes", "reserved_whole_bytes", "synth_s", "whole_s", "transformers"]
GRPO = dict(trainer="grpo", precision="bf16-mixed", grad_ckpt=True, attn_impl="sdpa", padded=True, seq_len=128,
            max_completion_length=64)
SETUPS = [
    ("HuggingFaceTB/SmolLM2-135M", dict(technique="lora", batch_size=8, num_generations=4)),
    ("Qwen/Qwen2.5-0.5B", dict(technique="lora", batch_size=8, num_generations=4, beta=0.04)),
    ("meta-llama/Llama-3.2-1B", dict(technique="full", batch_size=4, num_generations=2)),
    ("Qwen/Qwen2.5-0.5B", dict(technique="lora", batch_size=4, num_generations=4, grad_accum=2)),
    ("Qwen/Qwen3-0.6B", dict(technique="lora", batch_size=8, num_generations=4)),
]


def describe(fields: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def run(shard: int = 0, shards: int = 1) -> None:
    import transformers

    from memplan.fileio import append_csv_row_atomic
    from memplan.replay import decode
    from memplan.replay.need import traced_events
    from memplan.replay.synth import canonical, through_last_step
    from memplan.runtime.allocator import need_and_replay
    from memplan.setup import Setup
    out = RESULTS.with_name(f"decode_check.{shard}.csv") if shards > 1 else RESULTS
    done = {(r["model"], r["setup"]) for r in csv.DictReader(open(out))} if out.exists() else set()
    for i, (model, fields) in enumerate(SETUPS):
        if i % shards != shard or (model, describe(fields)) in done:
            continue
        setup = Setup(**GRPO, **fields)
        decode._verified.clear()
        t = time.time()
        made = traced_events(model, setup, 3)
        synth_s = time.time() - t
        synthesized = any(decode._verified.values())
        t = time.time()
        whole = traced_events(model, setup, 3, synthesize=False)
        whole_s = time.time() - t
        (need, free), (need_w, free_w) = need_and_replay(made), need_and_replay(whole)
        same = canonical(through_last_step(made)) == canonical(through_last_step(whole))
        append_csv_row_atomic(out, FIELDS, dict(
            model=model, setup=describe(fields), synthesized=synthesized, events=len(made), same_events=same,
            need_bytes=need, need_whole_bytes=need_w, reserved_bytes=free.peak_reserved,
            reserved_whole_bytes=free_w.peak_reserved, synth_s=round(synth_s, 1), whole_s=round(whole_s, 1),
            transformers=transformers.__version__))
        print(model, describe(fields), "synthesized" if synthesized else "traced whole", "same events" if same
              else "EVENTS DIFFER", f"need {need} vs {need_w}", f"{synth_s:.0f} s vs {whole_s:.0f} s", flush=True)


def report() -> None:
    from memplan.fileio import write_text_atomic
    rows = [r for f in sorted(RESULTS.parent.glob("decode_check*.csv")) for r in csv.DictReader(open(f))]
    same = sum(r["same_events"] == "True" and r["need_bytes"] == r["need_whole_bytes"]
               and r["reserved_bytes"] == r["reserved_whole_bytes"] for r in rows)
    lines = ["# GRPO's generations made from short runs, against whole traces", "",
             "`python benchmarks/decode_check.py` (memplan/replay/decode.py): each setup's GRPO run with 64-token "
             f"completions ({describe(GRPO)}) as traced_events makes it - its generations from runs of 8, 9 and 12 "
             "tokens - beside the run traced whole: the events (serials renumbered, bursts of frees as sets, through "
             "the last step) and the allocator replay's need and reserved peak. Seconds on 2 CPU cores.", "",
             f"{len(rows)} setups: {same} with the same events, need and reserved peak; synthesized in "
             f"{sum(r['synthesized'] == 'True' for r in rows)}.", "",
             "| model | setup | synthesized | events | same events | need GiB (whole) | reserved GiB (whole) "
             "| s (whole) |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    g = 2 ** 30
    for r in rows:
        lines.append(f"| {r['model']} | {r['setup']} | {r['synthesized']} | {r['events']} | {r['same_events']} | "
                     f"{int(r['need_bytes']) / g:.3f} ({int(r['need_whole_bytes']) / g:.3f}) | "
                     f"{int(r['reserved_bytes']) / g:.3f} ({int(r['reserved_whole_bytes']) / g:.3f}) | "
                     f"{r['synth_s']} ({r['whole_s']}) |")
    write_text_atomic(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines[4:5]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["report"]:
        report()
    else:
        shard, shards = (map(int, sys.argv[1].split("/")) if len(sys.argv) > 1 else (0, 1))
        run(shard, shards)
