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

# (model, setup fields, layers) - layers=None traces the whole model
MATRIX: list[tuple[str, dict, int | None]] = []


def _add(model, layers=None, **kw):
    MATRIX.append((model, kw, layers))


# GPT-2: tied embeddings, Conv1D, dropout 0.1, learned positions
_add("openai-community/gpt2", technique="full", precision="fp32", optimizer="adamw", batch_size=2, seq_len=128, attn_impl="eager")
_add("openai-community/gpt2", technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=4, seq_len=128, attn_impl="sdpa")
_add("openai-community/gpt2", technique="full", precision="fp32", optimizer="adafactor", batch_size=2, seq_len=256, attn_impl="sdpa", grad_ckpt=True)
_add("openai-community/gpt2", technique="lora", precision="fp32", batch_size=4, seq_len=128, attn_impl="eager")
_add("openai-community/gpt2", technique="lora", precision="bf16", lora_targets="all-linear", lora_r=16, batch_size=2, seq_len=256, attn_impl="sdpa", grad_ckpt=True)
_add("openai-community/gpt2", technique="freeze", precision="fp32", trainable=2, batch_size=4, seq_len=128, attn_impl="eager")
_add("openai-community/gpt2", technique="qlora", precision="bf16", double_quant=True, batch_size=2, seq_len=128, attn_impl="sdpa")
_add("openai-community/gpt2", technique="full", precision="fp32", optimizer="adamw-8bit", batch_size=2, seq_len=64, attn_impl="eager", grad_accum=4)
# Llama-3.2-1B: GQA, RMSNorm, SwiGLU, tied, 128k vocabulary
_add("meta-llama/Llama-3.2-1B", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=128)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="lora", precision="bf16", lora_targets="all-linear", lora_r=64, batch_size=1, seq_len=256, grad_ckpt=True)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="qlora", precision="bf16", double_quant=True, optimizer="paged-adamw-8bit", batch_size=2, seq_len=128, grad_ckpt=True)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="qlora", precision="bf16", lora_targets="all-linear", batch_size=1, seq_len=256, attn_impl="eager")
_add("meta-llama/Llama-3.2-1B", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=1, seq_len=128)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="full", precision="bf16", optimizer="adafactor", batch_size=2, seq_len=128, grad_ckpt=True)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="freeze", precision="bf16-mixed", optimizer="adamw-8bit", batch_size=2, seq_len=128)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="lora", precision="bf16", quant="int8", batch_size=1, seq_len=128)
# Qwen2.5-0.5B: GQA with q/k/v bias, tied
_add("Qwen/Qwen2.5-0.5B", layers=2, technique="lora", precision="bf16", batch_size=4, seq_len=128, attn_impl="eager")
_add("Qwen/Qwen2.5-0.5B", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw", batch_size=2, seq_len=128, attn_impl="sdpa")
_add("Qwen/Qwen2.5-0.5B", layers=2, technique="qlora", precision="bf16", batch_size=2, seq_len=256, grad_ckpt=True)
_add("Qwen/Qwen2.5-0.5B", layers=2, technique="full", precision="fp32", optimizer="adamw-fused", batch_size=1, seq_len=64, grad_ckpt=True)
# SmolLM2-135M: small Llama, whole model
_add("HuggingFaceTB/SmolLM2-135M", technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=4, seq_len=128)
_add("HuggingFaceTB/SmolLM2-135M", technique="lora", precision="fp32", lora_targets="all-linear", batch_size=2, seq_len=256, attn_impl="eager")
_add("HuggingFaceTB/SmolLM2-135M", technique="freeze", precision="fp32", trainable=3, batch_size=2, seq_len=128, grad_ckpt=True)
# Pythia-1B (GPT-NeoX: parallel block, two LayerNorms, untied)
_add("EleutherAI/pythia-1b", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=128)
_add("EleutherAI/pythia-1b", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=1, seq_len=128, attn_impl="eager")
_add("EleutherAI/pythia-1b", layers=2, technique="qlora", precision="bf16", batch_size=2, seq_len=128, grad_ckpt=True)
# T5 (encoder-decoder, relative position bias, dropout)
_add("google-t5/t5-small", technique="full", precision="fp32", optimizer="adamw", batch_size=4, seq_len=128, target_len=32, attn_impl="eager")
_add("google-t5/t5-small", technique="full", precision="bf16-mixed", optimizer="adafactor", batch_size=4, seq_len=128, target_len=64, attn_impl="eager")
_add("google-t5/t5-small", technique="lora", precision="fp32", batch_size=4, seq_len=128, target_len=32, attn_impl="eager")
_add("google-t5/t5-small", technique="freeze", precision="fp32", batch_size=4, seq_len=64, target_len=32, attn_impl="eager")
_add("google-t5/t5-base", layers=2, technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=256, target_len=64, attn_impl="eager", grad_ckpt=True)
_add("google-t5/t5-base", layers=2, technique="qlora", precision="bf16", batch_size=2, seq_len=128, target_len=32, attn_impl="eager")
_add("google-t5/t5-base", technique="freeze", precision="bf16-mixed", batch_size=8, seq_len=512, attn_impl="sdpa")
# BART (post-LN encoder-decoder, learned positions)
_add("facebook/bart-base", technique="full", precision="fp32", optimizer="adamw-fused", batch_size=2, seq_len=128, target_len=64, attn_impl="eager")
_add("facebook/bart-base", technique="lora", precision="bf16", batch_size=4, seq_len=128, target_len=64, attn_impl="sdpa")
_add("facebook/bart-base", technique="full", precision="bf16-mixed", optimizer="adamw-8bit", batch_size=2, seq_len=256, target_len=64, attn_impl="sdpa", grad_ckpt=True)
# BERT (encoder, post-LN, masked-LM head)
_add("google-bert/bert-base-uncased", technique="full", precision="fp32", optimizer="adamw", batch_size=4, seq_len=128, attn_impl="eager")
_add("google-bert/bert-base-uncased", technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=8, seq_len=128, attn_impl="sdpa")
_add("google-bert/bert-base-uncased", technique="lora", precision="fp32", batch_size=8, seq_len=128, attn_impl="eager")
_add("google-bert/bert-base-uncased", technique="freeze", precision="fp32", trainable=2, batch_size=8, seq_len=64, attn_impl="sdpa", grad_ckpt=True)
_add("google-bert/bert-base-uncased", technique="qlora", precision="bf16", batch_size=8, seq_len=128, attn_impl="sdpa")
# Mistral-7B-shaped (sliding window config, 32k vocabulary) and Llama-2-7B, cut to 2 blocks
_add("mistralai/Mistral-7B-v0.1", layers=2, technique="qlora", precision="bf16", double_quant=True, optimizer="paged-adamw-8bit", batch_size=1, seq_len=512, grad_ckpt=True)
_add("meta-llama/Llama-2-7b-hf", layers=2, technique="lora", precision="bf16", batch_size=1, seq_len=512, grad_ckpt=True)
_add("meta-llama/Llama-2-7b-hf", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw-8bit", batch_size=1, seq_len=256, grad_ckpt=True)
# Llama-3-8B QLoRA at rank 256 on every Linear with checkpointing: the forward peak holds autocast's cached bf16
# copies of the fp32 adapters (1.25 GiB; measured -4.0% on an H100 before they were counted)
_add("meta-llama/Meta-Llama-3-8B", layers=2, technique="qlora", precision="bf16", lora_r=256, lora_targets="all-linear", batch_size=2, seq_len=1024, attn_impl="sdpa", grad_ckpt=True)
# Gemma-2: final-logit and attention soft-capping (tanh saves its output), two masks (full + sliding), eager only
_add("google/gemma-2-2b", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=128)
_add("google/gemma-2-2b", layers=2, technique="qlora", precision="bf16", batch_size=1, seq_len=1024, grad_ckpt=True)
# Falcon-7B: multi-query attention handed to sdpa without enable_gqa (math kernel), parallel block
_add("tiiuae/falcon-7b", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=512)
_add("tiiuae/falcon-7b", layers=2, technique="lora", precision="bf16", batch_size=1, seq_len=2048, grad_ckpt=True)
# Mixtral-8x7B: fused experts through grouped_mm in the weights' dtype; peft's W + BA expert copies
_add("mistralai/Mixtral-8x7B-v0.1", layers=2, technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=128)
_add("mistralai/Mixtral-8x7B-v0.1", layers=2, technique="lora", precision="bf16-mixed", batch_size=2, seq_len=512)
_add("mistralai/Mixtral-8x7B-v0.1", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=1, seq_len=128)
# Phi-3 (fused qkv and gate_up, no peft default targets), GPT-BigCode (multi-query, causal-mask buffer), BLOOM
# (ALiBi), OPT (post-LN option, learned positions)
_add("microsoft/Phi-3-mini-4k-instruct", layers=2, technique="qlora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=256, grad_ckpt=True)
_add("bigcode/gpt_bigcode-santacoder", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=128)
_add("bigscience/bloom-560m", layers=2, technique="qlora", precision="bf16", batch_size=2, seq_len=256, grad_ckpt=True)
_add("facebook/opt-1.3b", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=128)
# T5 family: a trainable position bias under sdpa with dropout (CUDA's efficient kernel returns its gradient);
# flan-t5 / mT5 checkpoints keep their own lm_head, gated gelu_new MLPs, the shared embedding's two contributions
_add("google-t5/t5-small", technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=2, seq_len=128, attn_impl="sdpa")
_add("google/flan-t5-xl", layers=2, technique="lora", precision="bf16", batch_size=2, seq_len=128)
_add("bigscience/mt0-xxl", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=1, seq_len=128)
# T5 under sdpa with transformers >= 5.20: every self-attention layer keeps its own merged bias mask
_add("google-t5/t5-base", layers=2, technique="lora", precision="bf16", lora_r=64, batch_size=16, seq_len=256, attn_impl="sdpa")
_add("google-t5/t5-base", layers=2, technique="lora", precision="bf16-mixed", batch_size=8, seq_len=512, attn_impl="sdpa")
# Checkpointing hooks the embedding output (enable_input_require_grads): frozen blocks record and are back-propagated
_add("mistralai/Mistral-7B-v0.1", layers=2, technique="freeze", precision="bf16-mixed", batch_size=2, seq_len=256, grad_ckpt=True)
# CUDA autocast's fp32 ops (gelu_new's pow) and a rotary model's fp32 training cache under bf16-mixed
_add("openai-community/gpt2", technique="lora", precision="bf16-mixed", batch_size=2, seq_len=256)
_add("microsoft/phi-2", layers=2, technique="lora", precision="bf16-mixed", batch_size=2, seq_len=256)
# ... and under checkpointing, whose recompute must see the same fp32 ops (emulations.checkpoint_kwargs)
_add("openai-community/gpt2", technique="lora", precision="fp16-mixed", lora_r=16, lora_dropout=0.05, batch_size=2, seq_len=512, grad_ckpt=True)
# --layers: the backward's peak leaves the head for the blocks at 4 of 12 blocks (tracker: segments; the phase's
# own peak extrapolated from 2 and 3 blocks was 2.0% short of the full trace)
_add("openai-community/gpt2", layers=2, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=4, seq_len=128, attn_impl="sdpa")
# mT5's MT5LayerNorm is T5's RMSNorm (fp32 variance, keeps its input): taken for a LayerNorm before, -5.2%
_add("bigscience/mt0-xxl", layers=2, technique="lora", precision="bf16", batch_size=4, seq_len=256)
# Families outside the catalog, as small config.json shapes (benchmarks/shapes/README.md): peft has default LoRA
# targets for some (q/v), all-linear for the rest
SHAPES = ROOT / "benchmarks" / "shapes"
for _shape in ("qwen3", "olmo2", "starcoder2", "stablelm", "gptj", "cohere", "gemma3_text", "qwen2_moe", "mistral_sw",
               "granite", "phimoe", "gpt_neox", "qwen3_moe", "olmoe", "dots1", "cohere2", "olmo",
               "apertus", "roberta", "xlm-roberta", "mbart", "gpt_oss", "distilbert",
               "modernbert", "umt5", "gemma3", "mllama", "qwen2_5_vl", "bitnet", "deepseek_v2", "deepseek_v3",
               "qwen3_next", "deepseek_v32", "persimmon", "seed_oss"):
    _cfg = str(SHAPES / _shape / "config.json")
    # peft's all-linear wraps PhiMoE's router, whose forward returns a tuple peft cannot handle (a peft failure)
    _wide = "q_proj,k_proj,v_proj,o_proj" if _shape == "phimoe" else "all-linear"
    _attn_targets = {"gpt_neox": "query_key_value", "roberta": "query,value", "xlm-roberta": "query,value",
                     "distilbert": "q_lin,v_lin", "modernbert": "Wqkv", "umt5": "q,v",
                     "deepseek_v2": "q_proj,kv_b_proj", "deepseek_v3": "q_a_proj,kv_a_proj_with_mqa",
                     "deepseek_v32": "q_a_proj,kv_a_proj_with_mqa", "persimmon": "query_key_value"}.get(
        _shape, "q_proj,v_proj")
    _add(_cfg, technique="lora", precision="bf16", lora_targets=_wide, batch_size=2, seq_len=256)
    _add(_cfg, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=2, seq_len=256)
    if _shape != "phimoe":  # the tracer's QLoRA stand-ins fail inside PhiMoE's expert routing (a tracer limit)
        _add(_cfg, technique="qlora", precision="bf16", lora_targets=_wide, batch_size=2, seq_len=256, grad_ckpt=True)
    _add(_cfg, technique="lora", precision="bf16-mixed", batch_size=2, seq_len=256, attn_impl="eager",
         lora_targets=_attn_targets)
    # without autocast a trainable norm weight saves the normalised tensor in the family's own dtype (saves.py)
    _add(_cfg, technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=512)
    # without autocast the eager softmax's dtype is the family's own (Arch.eager_softmax_fp32, read from its code)
    _add(_cfg, technique="lora", precision="bf16", batch_size=2, seq_len=512, attn_impl="eager",
         lora_targets=_attn_targets)
# Llama-4's experts see every token and autocast their bmm (Arch.experts_dense); peft's all-linear and the tracer's
# QLoRA stand-ins fail on its router (it returns a tuple), so attention LoRA only
_cfg = str(SHAPES / "llama4_text" / "config.json")
_add(_cfg, technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=512)
_add(_cfg, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=2, seq_len=256)
_add(_cfg, technique="lora", precision="bf16", lora_targets="q_proj,v_proj", batch_size=2, seq_len=512)
# ALBERT runs its one shared layer num_hidden_layers times (Arch.block_runs); it cannot checkpoint
_cfg = str(SHAPES / "albert" / "config.json")
_add(_cfg, technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=512)
_add(_cfg, technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=2, seq_len=256)
_add(_cfg, technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=256)
_add(_cfg, technique="lora", precision="bf16-mixed", lora_targets="query,value", batch_size=2, seq_len=256,
     attn_impl="eager")
# Padded batches (Setup.padded): sdpa gets a boolean mask in every attention, converts it to a float bias per call
# and keeps it; grouped K/V are repeated to every head (no enable_gqa with a mask); encoder-decoders mask the encoder
# and the cross-attention, T5 merges the mask into its per-layer position-bias masks
for _m, _layers, _kw in (
        ("meta-llama/Llama-3.2-1B", 2, dict(technique="lora", precision="bf16", batch_size=4, seq_len=512)),
        ("meta-llama/Llama-3.2-1B", 2, dict(technique="full", precision="bf16-mixed", batch_size=2, seq_len=512)),
        ("Qwen/Qwen2.5-1.5B", 2, dict(technique="qlora", precision="bf16", batch_size=4, seq_len=512, grad_ckpt=True)),
        ("mistralai/Mistral-7B-v0.1", 2, dict(technique="lora", precision="bf16", batch_size=2, seq_len=1024)),
        ("openai-community/gpt2", None, dict(technique="full", precision="bf16-mixed", batch_size=4, seq_len=512)),
        ("google-bert/bert-base-uncased", None, dict(technique="full", precision="bf16-mixed", batch_size=8, seq_len=512)),
        ("facebook/bart-base", None, dict(technique="full", precision="bf16", batch_size=4, seq_len=512, target_len=128)),
        ("google-t5/t5-base", 2, dict(technique="lora", precision="bf16", lora_r=64, batch_size=16, seq_len=256)),
        ("microsoft/Phi-3-mini-4k-instruct", 2, dict(technique="lora", precision="bf16", lora_targets="qkv_proj",
                                                    batch_size=1, seq_len=2048)),
        (str(SHAPES / "gemma3_text" / "config.json"), None, dict(technique="full", precision="bf16", batch_size=2,
                                                                 seq_len=512)),
        (str(SHAPES / "mbart" / "config.json"), None, dict(technique="full", precision="bf16", batch_size=2, seq_len=1024)),
        (str(SHAPES / "modernbert" / "config.json"), None, dict(technique="full", precision="bf16", batch_size=2,
                                                                seq_len=512))):
    _add(_m, layers=_layers, attn_impl="sdpa", padded=True, **_kw)
# Checkpointed long sequences whose peak is inside a block's backward, not the loss (memplan.estimator.memory.block_ends): an
# eager softmax's backward after its block's MLP; a gated MLP's product backward in the last and the first block
_add("meta-llama/Llama-2-7b-hf", layers=2, technique="qlora", precision="bf16", batch_size=4, seq_len=2048, attn_impl="eager", grad_ckpt=True)
_add("mistralai/Mistral-7B-v0.1", layers=2, technique="lora", precision="bf16", batch_size=4, seq_len=1024, attn_impl="eager", grad_ckpt=True)
_add("mistralai/Mistral-7B-v0.1", layers=2, technique="qlora", precision="bf16", batch_size=8, seq_len=4096, grad_ckpt=True)
for _kw in (dict(technique="qlora", precision="bf16"), dict(technique="lora", precision="bf16"),
            dict(technique="lora", precision="bf16-mixed"), dict(technique="full", precision="bf16", optimizer="adamw-fused")):
    _add(str(SHAPES / "mistral_1k" / "config.json"), layers=2, batch_size=8, seq_len=4096, grad_ckpt=True, **_kw)
# Qwen3-Next's gated DeltaNet layers (linfacts: saves and backward working memory measured on fake tensors)
for _kw in (dict(technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=1024),
            dict(technique="lora", precision="bf16-mixed", lora_targets="all-linear", batch_size=4, seq_len=1024)):
    _add(str(SHAPES / "qwen3_next" / "config.json"), grad_ckpt=True, **_kw)
# Checkpointing with frozen embeddings keeps each lookup's output (a leaf that requires grad) beside the first block's
# input where dropout, positions or a norm follow
_add("openai-community/gpt2", technique="lora", precision="bf16", batch_size=32, seq_len=1024, grad_ckpt=True)
_add("google-t5/t5-base", layers=2, technique="lora", precision="bf16-mixed", batch_size=32, seq_len=512, attn_impl="eager", grad_ckpt=True)
_add("microsoft/phi-2", layers=2, technique="lora", precision="bf16", batch_size=16, seq_len=1024, grad_ckpt=True)
# fp32 grouped K/V: CUDA's flash kernel alone takes them and runs 16-bit only, so the math kernel runs (measured on an
# H100: the Llama-3.2-1B forward phase, Qwen2.5-1.5B's peak)
_add("meta-llama/Llama-3.2-1B", layers=2, technique="full", precision="fp32", optimizer="adamw-fused", batch_size=2, seq_len=512, attn_impl="sdpa")
_add("Qwen/Qwen2.5-1.5B", layers=2, technique="full", precision="fp32", optimizer="adamw-fused", batch_size=2, seq_len=512, attn_impl="sdpa")
# a gated gelu_new returns fp32 under autocast (pow promotes), which the gated product saves
_add("google/flan-t5-xl", layers=2, technique="lora", precision="bf16-mixed", batch_size=8, seq_len=512)

QUICK = [0, 3, 6, 8, 10, 13, 14, 16, 18, 25, 28, 29, 33, 37, 41, 44, 46, 47, 49, 51, 56, 57, 59, 61, 62, 64]  # the CI subset (tests/test_trace.py)


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
    args = ap.parse_args(argv)
    from memplan.errors import MemplanError
    rows = [MATRIX[i] for i in QUICK] if args.quick else MATRIX
    if args.catalog_only:
        rows = [r for r in rows if not r[0].startswith(str(SHAPES))]
    out, failed = [], []
    for i, (model, fields, layers) in enumerate(rows):
        try:
            setup, r, c, sec = run_row(model, fields, layers)
        except MemplanError as e:  # this release cannot run the setup, or not on fake tensors (TraceFailed)
            failed.append((model.replace(f"{ROOT}/", ""), label(fields), " ".join(str(e).split())[:240]))
            print(f"[{i + 1}/{len(rows)}] {model} {label(fields)}: not run", flush=True)
            continue
        out.append({"model": model.replace(f"{ROOT}/", ""), "setup": label(fields), "layers": layers or "all",
                    "traced_mib": c["traced_bytes"] / 2**20, "estimated_mib": c["estimated_bytes"] / 2**20,
                    "rel_error_pct": 100 * c["rel_error"], "traced_phase": c["traced_phase"],
                    "estimated_phase": c["estimated_phase"], "seconds": sec,
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
