"""How tight is the closed-form fit test? For a grid of training setups, the smallest allocator limit the caching
allocator's replay fits under (memplan.replay.need.replay_need: the whole model traced once, the limit bisected over
replays) beside the closed form's bound, Estimate.allocator_need_bytes (peak allocated + the largest tensor +
checkpointing's split cache).

    python benchmarks/replay_need.py run [SHARD/NSHARDS]   # appends results/replay_need.csv (resumable)
    python benchmarks/replay_need.py report                # results/replay_need.md

The replay is the reference here because it called fit/OOM as the GPU did in every capped run it was checked on
(benchmarks/results/allocator_replay.md); these setups need no GPU. A negative slack (closed form below the replay's
need) is a setup the planner could pick where it runs out of memory without the headroom; the headroom
(memplan.planner.budget.DEFAULT_HEADROOM) must cover the worst of them."""
from __future__ import annotations

import csv
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "replay_need.csv"
FIELDS = ["model", "setup", "peak_allocated_bytes", "largest_block_bytes", "closed_form_bytes", "replay_need_bytes",
          "estimate_reserved_bytes", "replay_reserved_bytes", "seconds", "transformers"]

SMALL = ["openai-community/gpt2", "openai-community/gpt2-medium", "google-bert/bert-large-uncased",
         "google-t5/t5-base", "facebook/bart-large", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-1.5B",
         "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "HuggingFaceTB/SmolLM2-135M"]
LARGE = ["meta-llama/Llama-2-7b-hf", "mistralai/Mistral-7B-v0.1"]
TECHNIQUES = {
    "full bf16-mixed": dict(technique="full", precision="bf16-mixed"),
    "full bf16 8bit ckpt": dict(technique="full", precision="bf16", optimizer="adamw-8bit", grad_ckpt=True),
    "lora bf16": dict(technique="lora", precision="bf16"),
    "qlora ckpt": dict(technique="qlora", precision="bf16", grad_ckpt=True),
}


def grid():
    from memplan.setup import Setup
    for model in SMALL + LARGE:
        for name, fields in TECHNIQUES.items():
            if model in LARGE and name.startswith("full"):
                continue
            for batch, seq in ((1, 512), (4, 512), (16, 512), (2, 2048)):
                if model in LARGE and batch == 16:
                    continue
                yield model, Setup(attn_impl="sdpa", padded=True, batch_size=batch, seq_len=seq, **fields)


def describe(s) -> str:
    return " ".join(p for p in (s.technique, s.precision, s.optimizer, f"b{s.batch_size}", f"s{s.seq_len}",
                                "ckpt" if s.grad_ckpt else "") if p)


def run(shard: int = 0, shards: int = 1) -> None:
    import transformers

    from memplan.errors import MemplanError
    from memplan.estimator.breakdown import estimate
    from memplan.fileio import append_csv_row_atomic
    from memplan.replay.need import replay_need
    out = RESULTS.with_name(f"replay_need.{shard}.csv") if shards > 1 else RESULTS
    done = {(r["model"], r["setup"]) for r in csv.DictReader(open(out))} if out.exists() else set()
    for i, (model, setup) in enumerate(grid()):
        if i % shards != shard or (model, describe(setup)) in done:
            continue
        t = time.time()
        try:
            e = estimate(model, setup)
            need, reserved = replay_need(model, setup, 3)
        except MemplanError as err:
            print(f"skip {model} {describe(setup)}: {str(err).splitlines()[0][:100]}")
            continue
        row = dict(model=model, setup=describe(setup), peak_allocated_bytes=e.peak_allocated_bytes,
                   largest_block_bytes=e.largest_block_bytes, closed_form_bytes=e.allocator_need_bytes,
                   replay_need_bytes=need, estimate_reserved_bytes=e.peak_reserved_bytes,
                   replay_reserved_bytes=reserved, seconds=round(time.time() - t, 1),
                   transformers=transformers.__version__)
        append_csv_row_atomic(out, FIELDS, row)
        slack = (e.allocator_need_bytes - need) / need
        print(f"{model} {describe(setup)}: closed form {slack:+.1%} vs the replay's need", flush=True)


def report() -> None:
    from memplan.fileio import write_text_atomic
    rows = []
    for f in sorted(RESULTS.parent.glob("replay_need*.csv")):
        rows += list(csv.DictReader(open(f)))
    g = 2 ** 30
    slack = sorted(((int(r["closed_form_bytes"]) - int(r["replay_need_bytes"])) / int(r["replay_need_bytes"]), r)
                   for r in rows)
    values = [s for s, _ in slack]
    releases = ", ".join(sorted({r.get("transformers") or "unrecorded" for r in rows}))
    lines = ["# The closed-form fit test against the allocator replay", "",
             "`python benchmarks/replay_need.py`: per setup, the closed form's bound (peak allocated + the largest "
             "tensor + the split cache of checkpointed steps, Estimate.allocator_need_bytes) against the smallest allocator limit the caching allocator's "
             "replay fits under (memplan.replay.need.replay_need). slack = (closed form - replay need) / replay need: "
             "negative where the closed form would accept a limit the step runs out of memory under. Traced under "
             f"transformers {releases}.", "",
             f"{len(rows)} setups: slack median {statistics.median(values):+.1%}, min {values[0]:+.1%}, "
             f"max {values[-1]:+.1%}; below zero: {sum(v < 0 for v in values)}.", "",
             "| model | setup | peak allocated GiB | largest GiB | closed form GiB | replay need GiB | slack |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for s, r in slack:
        lines.append(f"| {r['model']} | {r['setup']} | {int(r['peak_allocated_bytes']) / g:.2f} | "
                     f"{int(r['largest_block_bytes']) / g:.2f} | {int(r['closed_form_bytes']) / g:.2f} | "
                     f"{int(r['replay_need_bytes']) / g:.2f} | {s:+.1%} |")
    write_text_atomic(RESULTS.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        shard, shards = (map(int, sys.argv[2].split("/")) if len(sys.argv) > 2 else (0, 1))
        run(shard, shards)
    else:
        report()
