"""Whole-model check of the tracer's CUDA-autocast emulation against the real AutocastCUDA kernels (no GPU).

    python benchmarks/autocast_check.py [--layers 2] [MODEL ...]

For each model (cut to --layers blocks, bf16-mixed, eager attention, train mode, batch 2 x 64) one forward with
labels runs twice on fake tensors: as the tracer runs it (CPU tensors, CPU autocast + memplan.runtime.emulate.autocast)
and on fake CUDA tensors under CUDA autocast switched on directly (torch registers the AutocastCUDA kernels in
CPU-only builds). Every aten op with a floating-point input or output, views aside, is compared by (op, input dtypes and shapes,
output dtypes and shapes); a difference is an op the tracer runs in another precision than the GPU (or a cast
one side makes and the other does not). tests/test_cuda_parity.py checks the same op by op, in CI.

A CPU-only build cannot run all of a CUDA forward, so the CUDA side goes through shims: parameters are frozen
(autograd on a fake CUDA tensor needs a device guard, which aborts), factories asked for "cuda" are made on the CPU
and replaced by an empty fake CUDA tensor, Python indexing of CUDA tensors is done on a meta twin (as_strided
views; advanced indexing as an empty result), and methods whose Python binding takes a device guard
(`contiguous`) are called through torch.ops.aten. The shims only make integer and same-dtype tensors, which the
comparison skips; MoE models whose experts query the CUDA device (grouped_mm) cannot run here and are reported so.
Results: benchmarks/results/autocast_check.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "autocast_check.md"

MODELS = ["openai-community/gpt2", "google-bert/bert-base-uncased", "facebook/bart-large", "google-t5/t5-base",
          "google/flan-t5-xl", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-1.5B", "mistralai/Mistral-7B-v0.1",
          "google/gemma-2b", "google/gemma-2-2b", "microsoft/phi-2", "microsoft/Phi-3-mini-4k-instruct",
          "EleutherAI/pythia-1b", "bigscience/bloom-560m", "tiiuae/falcon-7b", "facebook/opt-1.3b",
          "bigcode/gpt_bigcode-santacoder", "mistralai/Mixtral-8x7B-v0.1"]

SETUPS = ["", "technique=lora,lora_targets=all-linear", "technique=qlora,precision=bf16,lora_targets=all-linear"]


def _op_log():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def desc(x):
        return [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tree_flatten(x)[0]
                if isinstance(t, torch.Tensor)]

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins, outs = desc((args, kwargs)), desc(out)
            floats = [d for d, _ in ins + outs if d in ("float32", "bfloat16", "float16")]
            same_dtype_copy = func is torch.ops.aten._to_copy.default and ins[:1] == outs[:1]
            returns = func._schema.returns
            if returns and all(r.alias_info is not None for r in returns):  # views (and in-place ops: the CPU's
                return out  # indexing is slice/select, the shims' as_strided; in-place ops keep their dtype)
            if floats and not same_dtype_copy and not str(func).startswith(("prim.", "aten.empty")):
                self.ops[(str(func), tuple(ins), tuple(outs))] += 1
            return out

    return Log()


def _cuda_shims():
    """The torch-function mode that lets a CPU-only build run a forward on fake CUDA tensors (module docstring)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda(d):
        return isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda"

    class Shims(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.__getitem__ and args[0].device.type == "cuda":
                return self.index(*args)
            if func is torch.Tensor.__setitem__ and args[0].device.type == "cuda":
                return None
            moved = is_cuda(kwargs.get("device"))
            if moved:
                kwargs["device"] = "cpu"
            args = list(args)
            for i, a in enumerate(args):
                if is_cuda(a) and not isinstance(a, torch.Tensor):
                    args[i], moved = "cpu", True
            try:
                out = func(*args, **kwargs)
            except RuntimeError as e:
                if "not linked with support for cuda" not in str(e):
                    raise
                out = getattr(torch.ops.aten, func.__name__.strip("_"))(*args, **kwargs)
            if moved and isinstance(out, torch.Tensor) and out.device.type == "cpu":
                with torch._C.DisableTorchFunction():
                    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="cuda")
            return out

        @staticmethod
        def index(x, idx):
            parts = idx if isinstance(idx, tuple) else (idx,)
            with torch._C.DisableTorchFunction():
                if any(isinstance(p, torch.Tensor) for p in parts):
                    meta = tuple(torch.empty(p.shape, dtype=p.dtype, device="meta") if isinstance(p, torch.Tensor)
                                 else p for p in parts)
                    r = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")[meta]
                    return torch.empty(r.shape, dtype=x.dtype, device="cuda")
                r = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")[idx]
                return x.as_strided(r.shape, r.stride(), x.storage_offset() + r.storage_offset())

    return Shims()


def forward_ops(model_id: str, dev: str, layers: int, fields: dict | None = None) -> collections.Counter:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memplan.runtime.emulate.cuda as E
    from memplan.runtime.emulate.autocast import autocast_switched_on
    from memplan.runtime import steps as S
    from memplan.model.catalog import config_dict, load_spec
    from memplan.setup import Setup

    spec = load_spec(model_id)
    setup = Setup(**{**dict(precision="bf16-mixed", batch_size=2, seq_len=64, attn_impl="eager"), **(fields or {})})
    model = S.build_model(spec, setup, layers, S.cut_config(config_dict(spec), layers))
    model.train()
    vocab = model.get_input_embeddings().num_embeddings
    log = _op_log()
    original = E.cuda_autocast_fp32
    if dev == "cuda":  # the real policy applies: no emulation
        E.cuda_autocast_fp32 = contextlib.nullcontext
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), E.cuda_like(setup.padded, spec.arch.kind == "seq2seq"):
            S.materialize(model, True, dev)
            for p in model.parameters():
                p.requires_grad_(False)
            batch = S.make_batch(spec, setup, vocab, dev)
            autocast = (autocast_switched_on("cuda", torch.bfloat16) if dev == "cuda"
                        else torch.autocast("cpu", dtype=torch.bfloat16))
            with autocast, (_cuda_shims() if dev == "cuda" else contextlib.nullcontext()), log:
                model(**batch)
    finally:
        E.cuda_autocast_fp32 = original
    return log.ops


def check(model_id: str, layers: int, fields: dict | None = None) -> tuple[str, int, list[str]]:
    """(status, ops compared, differences)."""
    try:
        cpu, cuda = (forward_ops(model_id, dev, layers, fields) for dev in ("cpu", "cuda"))
    except Exception as e:  # a forward the CPU-only build cannot run on fake CUDA tensors
        return f"not run: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}", 0, []
    diffs = [f"{op} {ins} -> {outs}: tracer {cpu[k]}, CUDA {cuda[k]}"
             for k in sorted(cpu.keys() | cuda.keys()) if cpu[k] != cuda[k] for op, ins, outs in [k]]
    return ("same" if not diffs else "differs"), sum(cuda.values()), diffs


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--setup", action="append", help="Setup fields over the default, e.g. technique=lora,lora_r=8 "
                    "(repeatable; default: full, LoRA all-linear, QLoRA). Not grad_ckpt: checkpointing's forward "
                    "takes a CUDA device guard, which aborts a CPU-only build (its forward's dtypes are the same)")
    args = ap.parse_args(argv)
    import yaml
    setups = args.setup or SETUPS
    if any("grad_ckpt" in s for s in setups):
        ap.error("--setup: grad_ckpt cannot run on fake CUDA tensors here (see --help)")
    import torch
    import transformers

    from memplan.fileio import write_text_atomic
    lines = ["# Autocast emulation vs the AutocastCUDA kernels", "",
             f"`python benchmarks/autocast_check.py` ({datetime.date.today()}, torch {torch.__version__}, "
             f"transformers {transformers.__version__}; {args.layers} blocks, bf16-mixed, eager, batch 2 x 64 unless "
             "the setup says otherwise; one training-mode forward with labels). Ops with a floating-point tensor, by op, dtypes and shapes.", "",
             "| model | setup | result | ops compared | differences |", "|---|---|---|---|---|"]
    bad = 0
    for setup in setups:
        fields = {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in setup.split(",") if p)}
        for m in args.models:
            t0 = time.time()
            status, n, diffs = check(m, args.layers, fields)
            bad += status == "differs"
            print(f"{m} {setup or 'full'}: {status} ({n} ops, {time.time() - t0:.0f} s)", *diffs, sep="\n  ",
                  flush=True)
            lines.append(f"| {m} | {setup or 'full'} | {status} | {n} | {'<br>'.join(diffs) or '-'} |")
    write_text_atomic(OUT, "\n".join(lines) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
