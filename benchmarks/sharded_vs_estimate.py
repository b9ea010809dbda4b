"""Estimate vs the sharded tracer: rank 0 of real torch FSDP2 (accelerate's per-block wrapping and bf16 policy) over
a fake process group (memplan.tracer.sharded), 9 catalog models x 4 setups (full shard with checkpointing, LoRA over
8 ranks, shard-grad-op with eager attention, layer freezing).

    python benchmarks/sharded_vs_estimate.py

Writes benchmarks/results/trace_vs_estimate_sharded.{md,csv} (the layout of trace_vs_estimate.py). Each model is
traced whole (fake tensors: Mistral-7B in ~11 s): extrapolating a sharded trace from cut models can miss what its
edge units hold (gpt2-xl full shard checkpointed: 6.03 GiB from 3 and 4, or 8 and 9 blocks, 6.57 GiB whole). A stress run of these setups found FSDP's loss backward holding one block, not two, LoRA
adapters computing in 16 bit, accelerate's autocast over the 16-bit parameters and no sharded gradient before the
last block's backward (docs/MODEL.md, "Several GPUs").
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_vs_estimate as tv  # noqa: E402

MODELS = ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-1.5B", "openai-community/gpt2-xl", "mistralai/Mistral-7B-v0.1",
          "google/gemma-2-2b", "microsoft/phi-2", "google-t5/t5-base", "facebook/bart-large", "tiiuae/falcon-7b"]
SETUPS = [dict(technique="full", precision="bf16-mixed", sharding="fsdp-full-shard", num_gpus=4, batch_size=4,
               seq_len=512, grad_ckpt=True),
          dict(technique="lora", precision="bf16", sharding="fsdp-full-shard", num_gpus=8, batch_size=2, seq_len=1024),
          dict(technique="full", precision="bf16", optimizer="adamw", sharding="fsdp-shard-grad-op", num_gpus=2,
               batch_size=2, seq_len=512, attn_impl="eager"),
          dict(technique="freeze", trainable="2", precision="bf16-mixed", sharding="fsdp-full-shard", num_gpus=4,
               batch_size=4, seq_len=512)]


def rows() -> list[tuple[str, dict, int]]:
    out = []
    for model in MODELS:
        for fields in SETUPS:
            extra = {"attn_impl": "eager"} if "gemma-2" in model else {}  # Gemma-2 has no sdpa in transformers 5
            out.append((model, {**fields, **extra}, None))
    return out


def run_row(model: str, fields: dict, layers):
    from memplan.estimator.breakdown import estimate
    from memplan.setup import Setup
    from memplan.tracer.training import compare
    from memplan.tracer.sharded import trace_sharded

    setup = Setup(**fields)
    t0 = time.perf_counter()
    result = trace_sharded(model, setup, layers=layers)
    seconds = time.perf_counter() - t0
    return setup, result, compare(result, estimate(model, setup)), seconds


def main() -> int:
    tv.MATRIX[:] = rows()
    tv.run_row = run_row
    return tv.main(["--tag", "sharded"])


if __name__ == "__main__":
    sys.exit(main())
