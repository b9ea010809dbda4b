"""`memplan trace --layers N` against the full model's trace: is the extrapolation exact?

    python benchmarks/trace_layers.py [--layers 2]

Traces each setup twice, whole and cut to N and N+1 blocks (memplan.tracer.training: per-segment extrapolation), and writes
benchmarks/results/trace_layers.md with both peaks per phase. The models are small enough to trace whole on a CPU
(Mistral-7B's 32 blocks take ~20 s under fake tensors); the setups are the ones where a phase's peak moves between
places as the model deepens (GPT-2 full fine-tuning's backward, Mistral-7B's frozen blocks under checkpointing),
two stacks (T5, BART), an encoder (BERT), QLoRA, and freezing.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES: list[tuple[str, dict]] = [
    ("openai-community/gpt2", dict(technique="full", precision="fp32", optimizer="adamw", batch_size=2, seq_len=128)),
    ("openai-community/gpt2", dict(technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=4,
                                   seq_len=128, attn_impl="sdpa")),
    ("openai-community/gpt2", dict(technique="full", precision="fp32", optimizer="adafactor", batch_size=2,
                                   seq_len=256, grad_ckpt=True)),
    ("openai-community/gpt2", dict(technique="lora", precision="fp32", batch_size=4, seq_len=128)),
    ("openai-community/gpt2", dict(technique="full", precision="bf16-mixed", optimizer="adamw", batch_size=8,
                                   seq_len=512, grad_ckpt=True)),
    ("openai-community/gpt2", dict(technique="freeze", precision="bf16-mixed", trainable=2, batch_size=4,
                                   seq_len=256)),
    ("Qwen/Qwen2.5-0.5B", dict(technique="full", precision="bf16-mixed", optimizer="adamw", batch_size=2, seq_len=128,
                               attn_impl="sdpa")),
    ("Qwen/Qwen2.5-0.5B", dict(technique="lora", precision="bf16", batch_size=4, seq_len=128, attn_impl="eager")),
    ("Qwen/Qwen2.5-0.5B", dict(technique="qlora", precision="bf16", batch_size=2, seq_len=256, grad_ckpt=True)),
    ("Qwen/Qwen2.5-0.5B", dict(technique="full", precision="bf16", optimizer="adafactor", batch_size=4, seq_len=256,
                               grad_ckpt=True)),
    ("google-t5/t5-small", dict(technique="full", precision="fp32", batch_size=4, seq_len=128, target_len=32)),
    ("google-t5/t5-small", dict(technique="lora", precision="bf16-mixed", batch_size=4, seq_len=256, grad_ckpt=True,
                                attn_impl="eager")),
    ("google-t5/t5-small", dict(technique="freeze", precision="bf16-mixed", batch_size=4, seq_len=256)),
    ("google-bert/bert-base-uncased", dict(technique="full", precision="bf16-mixed", batch_size=8, seq_len=128)),
    ("google-bert/bert-base-uncased", dict(technique="lora", precision="fp32", batch_size=8, seq_len=256,
                                           grad_ckpt=True)),
    ("facebook/bart-base", dict(technique="full", precision="bf16-mixed", batch_size=4, seq_len=128)),
    ("mistralai/Mistral-7B-v0.1", dict(technique="freeze", precision="bf16-mixed", batch_size=2, seq_len=256,
                                       grad_ckpt=True)),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    import transformers

    import memplan
    from memplan.fileio import write_text_atomic
    from memplan.setup import Setup
    from memplan.tracer.training import trace

    rows, worst = [], 0.0
    for i, (model, fields) in enumerate(CASES):
        setup = Setup(**fields)
        t = time.perf_counter()
        full = trace(model, setup)
        t_full, t = time.perf_counter() - t, time.perf_counter()
        cut = trace(model, setup, layers=args.layers)
        t_cut = time.perf_counter() - t
        err = max(abs(cut.phases[p] - v) / v for p, v in full.phases.items())
        worst = max(worst, err)
        label = " ".join(f"{k}={v}" for k, v in fields.items())
        phases = " · ".join(f"{p} {full.phases[p] / 2**20:,.1f} / {cut.phases[p] / 2**20:,.1f}" for p in full.phases)
        rows.append(f"| {model} | {label} | {cut.layers_traced} of {cut.layers_total} | {phases} | {100 * err:.3f}% | "
                    f"{t_full:.0f} s / {t_cut:.0f} s |")
        print(f"[{i + 1}/{len(CASES)}] {model} {label}: worst phase {100 * err:.3f}%", flush=True)
    head = (f"{datetime.date.today()} · memplan {memplan.__version__} · torch {torch.__version__} · transformers "
            f"{transformers.__version__} · --layers {args.layers} · {len(CASES)} setups · worst phase peak "
            f"|error| {100 * worst:.3f}%")
    lines = ["# `trace --layers` vs the whole model's trace", "", head, "",
             "Per phase: the whole model's peak / the extrapolated peak, MiB.", "",
             "| model | setup | blocks traced | phases (whole / extrapolated) | worst | time whole / cut |",
             "|---|---|---|---|---:|---|", *rows]
    out = ROOT / "benchmarks" / "results" / "trace_layers.md"
    write_text_atomic(out, "\n".join(lines) + "\n")
    print(head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
