"""Synthesized training events (memplan.replay.synth) against whole-model traces: equal, and how much faster?

    python benchmarks/synth_check.py

Per setup: the events memplan.replay.need.traced_events synthesizes from a 5-block cut (after a first call for the setup
at batch 1, which pays the per-setup costs: the full-depth optimizer run and the check against a 7-block trace),
the whole model traced, both compared event by event (memplan.replay.synth.canonical) and replayed through the caching
allocator (peak reserved, allocated, and the smallest limit that fits). Results: benchmarks/results/synth_check.md.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "synth_check.md"

CASES: list[tuple[str, dict]] = [
    ("openai-community/gpt2", dict(technique="full", precision="bf16-mixed", batch_size=6, seq_len=1024,
                                   attn_impl="sdpa", padded=True)),
    ("openai-community/gpt2-xl", dict(technique="full", precision="bf16", optimizer="adafactor", grad_ckpt=True,
                                      batch_size=24, seq_len=1024, attn_impl="sdpa", padded=True)),
    ("google-t5/t5-base", dict(technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=7,
                               seq_len=512, attn_impl="sdpa", padded=True)),
    ("google-bert/bert-large-uncased", dict(technique="full", precision="fp32", batch_size=7, seq_len=512,
                                            padded=True)),
    ("facebook/bart-large", dict(technique="lora", precision="bf16-mixed", batch_size=6, seq_len=512, padded=True)),
    ("meta-llama/Llama-3.2-1B", dict(technique="full", precision="bf16", optimizer="adamw-8bit", grad_ckpt=True,
                                     batch_size=4, seq_len=2048, padded=True)),
    ("Qwen/Qwen2.5-1.5B", dict(technique="qlora", precision="bf16", grad_ckpt=True, batch_size=2, seq_len=1024,
                               padded=True)),
    ("meta-llama/Llama-2-7b-hf", dict(technique="qlora", precision="bf16", grad_ckpt=True, batch_size=5,
                                      seq_len=512, padded=True)),
    ("mistralai/Mistral-7B-v0.1", dict(technique="lora", precision="bf16", grad_ckpt=True, batch_size=11,
                                       seq_len=2048, padded=True)),
    ("google/flan-t5-xl", dict(technique="freeze", precision="bf16-mixed", optimizer="adamw-fused", batch_size=8,
                               seq_len=512, attn_impl="sdpa")),
    ("mistralai/Mixtral-8x7B-v0.1", dict(technique="qlora", precision="bf16", grad_ckpt=True, batch_size=1,
                                         seq_len=512)),
    ("google/gemma-2-2b", dict(technique="lora", precision="bf16", batch_size=2, seq_len=512)),
    ("openai-community/gpt2", dict(technique="freeze", precision="fp32", trainable=4, batch_size=2, seq_len=512)),
]


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from memplan.replay import synth
    from memplan.runtime.allocator import min_limit
    from memplan.fileio import write_text_atomic
    from memplan.setup import Setup
    from memplan.replay.need import traced_events
    from memplan.runtime.allocator import cuda_workspaces, replayed

    lines = ["# Synthesized events vs whole-model traces", "",
             f"`python benchmarks/synth_check.py` ({datetime.date.today()}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}, 2 CPU cores). 3 training steps. *synthesized*: memplan.replay.synth from a 5-block "
             "cut after the setup's first call (full-depth optimizer run and 7-block check paid there, "
             "*first call*); *whole*: the whole model traced. *equal*: the same events, serials renumbered and each "
             "burst of frees as a set; the replay columns are the caching allocator's over the synthesized events "
             "(the whole trace's are the same where equal).", "",
             "| model | setup | synthesized | first call | whole | equal | reserved GiB | need GiB |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    bad = 0
    for model, fields in CASES:
        setup = Setup(**fields)
        label = " ".join(f"{k}={v}" for k, v in fields.items())
        t0 = time.time()
        traced_events(model, Setup(**{**fields, "batch_size": 1}), 3)
        t1 = time.time()
        made = traced_events(model, setup, 3)
        t2 = time.time()
        whole = traced_events(model, setup, 3, synthesize=False)
        t3 = time.time()
        used = any(isinstance(e[0], tuple) for e in made)
        equal = synth.canonical(synth.through_last_step(made)) == synth.canonical(synth.through_last_step(whole))
        bad += not equal
        r = replayed(made)
        need = min_limit(made, cuda_workspaces(), uncapped=r)
        verdict = ("yes" if equal else "**NO**") if used else "traced whole (declined)"
        print(f"{model} {label}: {verdict}, {t2 - t1:.1f} s vs {t3 - t2:.1f} s", flush=True)
        lines.append(f"| {model} | {label} | {f'{t2 - t1:.1f} s' if used else '-'} | {t1 - t0:.1f} s | "
                     f"{t3 - t2:.1f} s | {verdict} | {r.peak_reserved / 2**30:.2f} | {need / 2**30:.2f} |")
    write_text_atomic(OUT, "\n".join(lines) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
