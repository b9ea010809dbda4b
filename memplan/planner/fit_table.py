"""fit(): "will it fit on this GPU, and how?" - one row per common setup, with the largest micro-batch.

A setup fits when its need is within the GPU's budget (memplan.planner.budget: the same test plan and doctor use).
Pure: the estimator is injected (tests pass a fake and check the probe order).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from memplan.planner import budget as _budget
from memplan.planner.budget import DEFAULT_HEADROOM, fits, need_bytes
from memplan.errors import MemplanError
from memplan.gpus import Gpu
from memplan.setup import LORA_PREQUANTIZED, PREQUANTIZED, Setup
from memplan.estimator.breakdown import estimator_for

#: option name -> (mode, Setup overrides). "{bf}" is bf16 on GPUs that support it, else fp16. The QLoRA row is
#: the QLoRA paper's recipe (arXiv:2305.14314: NF4 + double quant, paged AdamW, checkpointing, bf16 compute).
FIT_OPTIONS: tuple[tuple[str, dict], ...] = (
    ("inference {bf}", {"mode": "infer", "precision": "{bf}"}),
    ("inference int8", {"mode": "infer", "precision": "{bf}", "quant": "int8"}),
    ("inference 4-bit nf4", {"mode": "infer", "precision": "{bf}", "quant": "nf4"}),
    ("full fine-tune ({bf}-mixed, AdamW)", {"technique": "full", "precision": "{bf}-mixed",
                                            "optimizer": "adamw-fused"}),
    ("full + 8-bit AdamW + checkpointing", {"technique": "full", "precision": "{bf}-mixed",
                                            "optimizer": "adamw-8bit", "grad_ckpt": True}),
    ("LoRA r=8 on a {bf} base", {"technique": "lora", "precision": "{bf}", "optimizer": "adamw-fused"}),
    # issue 39's knobs: DoRA costs memory (two saved [tokens, out] tensors per layer, the norm rebuild); Liger's
    # fused cross-entropy saves the logits (Llama, Mistral, Qwen2/3, Gemma 1-3: n/a elsewhere, saying why)
    ("LoRA r=8 + DoRA on a {bf} base", {"technique": "lora", "precision": "{bf}", "optimizer": "adamw-fused",
                                        "use_dora": True}),
    ("LoRA r=8 + Liger Kernel on a {bf} base", {"technique": "lora", "precision": "{bf}", "optimizer": "adamw-fused",
                                                "use_liger_kernel": True}),
    ("QLoRA nf4 (double quant, paged 8-bit AdamW, checkpointing)",
     {"technique": "qlora", "quant": "nf4", "double_quant": True, "precision": "{bf}",
      "optimizer": "paged-adamw-8bit", "grad_ckpt": True}),
    # TRL's trainers with a LoRA adapter on a 16-bit base (model_init_kwargs dtype; TRL alone loads fp32) and TRL's
    # checkpointing: SFT; DPO with the adapter-off reference (batch = pairs); GRPO generating with generate() (batch
    # = completions, 2 per prompt, 2 accumulation steps so that every micro-batch size divides into prompts)
    ("TRL SFT, LoRA r=8 on a {bf} base, checkpointing", {"trainer": "sft", "technique": "lora", "precision": "{bf}",
                                          "grad_ckpt": True}),
    # TRL over bitsandbytes: no k-bit preparation, adapters cast to bf16 (Setup.trl_kbit): leaner than Trainer's QLoRA
    ("TRL SFT, QLoRA nf4 ({bf} compute), checkpointing", {"trainer": "sft", "technique": "qlora", "quant": "nf4",
                                                          "precision": "{bf}", "grad_ckpt": True}),
    # SFTConfig.activation_offloading: the checkpointed blocks' inputs in pinned host memory (memory.offload)
    ("TRL SFT, LoRA r=8 on a {bf} base, checkpointing + activation offloading",
     {"trainer": "sft", "technique": "lora", "precision": "{bf}", "grad_ckpt": True, "activation_offloading": True}),
    ("TRL DPO, LoRA r=8 on a {bf} base, checkpointing (pairs per batch)", {"trainer": "dpo", "technique": "lora",
                                                            "precision": "{bf}", "grad_ckpt": True}),
    ("TRL GRPO, LoRA r=8 on a {bf} base (2 x 256-token completions per prompt)",
     {"trainer": "grpo", "technique": "lora", "precision": "{bf}", "grad_ckpt": True, "num_generations": 2,
      "grad_accum": 2, "max_completion_length": 256}),
)
DEFAULT_NEW_TOKENS = 128

#: training across several GPUs of the card: option -> Setup overrides (checkpointing on: the usual recipe once a
#: model outgrows one card). Full fine-tuning with each sharding engine; LoRA/QLoRA replicated (DDP) where the
#: base fits, sharded (FSDP) where it does not.
SCALE_OUT_OPTIONS: tuple[tuple[str, dict], ...] = (
    ("full fine-tune, DeepSpeed ZeRO-3", {"technique": "full", "precision": "{bf}-mixed", "optimizer": "adamw-fused",
                                          "grad_ckpt": True, "sharding": "zero3"}),
    ("full fine-tune, FSDP full shard", {"technique": "full", "precision": "{bf}-mixed", "optimizer": "adamw-fused",
                                         "grad_ckpt": True, "sharding": "fsdp-full-shard"}),
    ("full fine-tune, ZeRO-3 + CPU optimizer offload", {"technique": "full", "precision": "{bf}-mixed",
                                                        "optimizer": "adamw-fused", "grad_ckpt": True,
                                                        "sharding": "zero3", "offload": "optimizer"}),
    ("LoRA r=8 on a {bf} base, DDP", {"technique": "lora", "precision": "{bf}", "optimizer": "adamw-fused",
                                       "grad_ckpt": True, "sharding": "ddp"}),
    ("LoRA r=8 on a {bf} base, FSDP full shard", {"technique": "lora", "precision": "{bf}",
                                                   "optimizer": "adamw-fused", "grad_ckpt": True,
                                                   "sharding": "fsdp-full-shard"}),
    ("QLoRA nf4, DDP", {"technique": "qlora", "quant": "nf4", "double_quant": True, "precision": "{bf}",
                        "optimizer": "paged-adamw-8bit", "grad_ckpt": True, "sharding": "ddp"}),
)
#: GPU counts tried for "fewest GPUs": within one node (1, 2, 4, 8), then whole 8-GPU nodes up to 64 nodes
GPU_COUNTS: tuple[int, ...] = (1, 2, 4, 8) + tuple(range(16, 513, 8))
GPUS_PER_NODE = 8


def gpu_layout(world: int) -> dict:
    """Setup fields for `world` GPUs: one node up to GPUS_PER_NODE, else whole nodes of GPUS_PER_NODE."""
    if world <= GPUS_PER_NODE:
        return {"num_gpus": world, "num_nodes": 1}
    return {"num_gpus": GPUS_PER_NODE, "num_nodes": math.ceil(world / GPUS_PER_NODE)}


@dataclass(frozen=True, slots=True)
class FitRow:
    option: str
    setup: Setup
    fits: bool
    max_batch_size: int
    need_bytes_at_batch_1: int  # memplan.planner.budget.need_bytes
    shortfall_bytes: int  # how much more than the budget batch 1 needs (0 when it fits)
    estimate_at_batch_1: object = None  # Estimate
    error: str = ""  # why this option does not apply to the model

    def to_dict(self) -> dict:
        e = self.estimate_at_batch_1
        return {"option": self.option, "mode": self.setup.mode, "setup": self.setup.to_dict(), "fits": self.fits,
                "max_batch_size": self.max_batch_size, "need_bytes_at_batch_1": self.need_bytes_at_batch_1,
                "device_total_bytes_at_batch_1": e.device_total_bytes if e is not None else 0,
                "shortfall_bytes": self.shortfall_bytes, "error": self.error}


@dataclass(frozen=True, slots=True)
class ScaleOutRow:
    """One multi-GPU training option: the fewest GPUs of the card where micro-batch 1 fits (0: not within
    max(GPU_COUNTS), or the given count does not fit), what each GPU needs there and the largest micro-batch."""

    option: str
    setup: Setup  # at the GPU count found (or tried), batch 1
    gpus: int
    need_bytes_at_batch_1: int  # memplan.planner.budget.need_bytes per GPU
    host_bytes_per_node: int
    max_batch_size: int
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.gpus > 0

    def to_dict(self) -> dict:
        return {"option": self.option, "setup": self.setup.to_dict(), "fits": self.fits, "gpus": self.gpus,
                "need_bytes_at_batch_1": self.need_bytes_at_batch_1, "host_bytes_per_node": self.host_bytes_per_node,
                "max_batch_size": self.max_batch_size, "error": self.error}


@dataclass(frozen=True, slots=True)
class FitResult:
    model: str
    gpu: Gpu
    seq_len: int
    rows: tuple[FitRow, ...]
    scale_out: tuple[ScaleOutRow, ...] = ()
    num_gpus: int | None = None  # the GPU count asked for (None: the fewest that fit)
    headroom: float = DEFAULT_HEADROOM
    budget_bytes: int = 0  # memplan.planner.budget.budget_bytes of the GPU

    @property
    def any_fits(self) -> bool:
        return any(r.fits for r in self.rows)

    def _repr_html_(self) -> str:
        """A notebook shows which options fit, their largest micro-batch and need."""
        from html import escape
        cols = ["option", "fits", "max_batch_size", "need_bytes_at_batch_1", "shortfall_bytes", "error"]
        head = f"<b>{escape(self.model)}</b> on {escape(self.gpu.name)} (budget {self.budget_bytes / 2**30:.2f} GiB)"
        return head + self.to_frame()[cols].to_html(index=False)

    def to_frame(self):
        """The one-GPU options as a pandas DataFrame (the columns of FitRow.to_dict, setup fields flattened)."""
        import pandas as pd
        return pd.DataFrame([{**{k: v for k, v in r.to_dict().items() if k != "setup"}, **r.setup.to_dict()}
                             for r in self.rows])

    def to_dict(self) -> dict:
        return {"model": self.model, "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
                "headroom": self.headroom, "budget_bytes": self.budget_bytes, "seq_len": self.seq_len,
                "options": [r.to_dict() for r in self.rows], "num_gpus": self.num_gpus,
                "multi_gpu": [r.to_dict() for r in self.scale_out]}


def option_setups(spec, gpu: Gpu, seq_len: int, options=FIT_OPTIONS, padded: bool = True) -> list[tuple[str, Setup]]:
    """The FIT_OPTIONS (or `options`) rows as Setups for this model, GPU and sequence length (batch 1), with padded
    batches (Setup.padded) unless `padded` is False: the batches a padding collator makes from real data, as the
    planner assumes (search.plan)."""
    bf = "bf16" if gpu.bf16 else "fp16"
    a = spec.arch
    if spec.checkpoint_quant in PREQUANTIZED and options is FIT_OPTIONS:
        # a stored-quantized upload loads as stored: served, and with a LoRA adapter where memplan models training
        # on the format (GPTQ: peft's GPTQLoraLinear, checkpointing as prepare_model_for_kbit_training enables it;
        # AWQ: AwqLoraLinear over gptqmodel's trainable kernel; FP8: transformers' FP8LinearFunction; checkpointing
        # as Trainer's gradient_checkpointing)
        q = spec.checkpoint_quant
        options = ((f"inference {q} (as stored)", {"mode": "infer", "precision": "{bf}", "quant": q}),)
        if q in LORA_PREQUANTIZED:  # AWQ trains in fp16 (transformers loads it so on CUDA): fp16-mixed
            precision = "fp16-mixed" if q == "awq" else "{bf}"
            options += ((f"LoRA r=8 on the {q} base (checkpointing)", {"technique": "lora", "quant": q,
                                                                       "precision": precision, "grad_ckpt": True,
                                                                       "optimizer": "adamw-fused"}),)
    if a.model_type == "gpt_oss" and options is FIT_OPTIONS:  # its checkpoint's experts are MXFP4: served as stored
        options = options[:1] + (("inference mxfp4 (as stored)", {"mode": "infer", "precision": "{bf}",
                                                                   "quant": "mxfp4"}),) + options[1:]
    elif (a.kind == "causal" and a.has_lm_head and options is FIT_OPTIONS and not spec.checkpoint_quant
          and not spec.fused_experts):  # fused experts: a quantized upload's are not modelled (ModelSpec)
        # what a 4-bit GPTQ upload of the model (…-GPTQ-Int4, as most families publish) would serve with
        options = options[:3] + (("inference from a 4-bit GPTQ upload", {"mode": "infer", "precision": "{bf}",
                                                                         "quant": "gptq-int4"}),) + options[3:]
    new = 0 if a.kind == "encoder" or not a.has_lm_head else DEFAULT_NEW_TOKENS  # a classifier serves one forward
    if a.max_positions:
        new = max(0, min(new, a.max_positions - seq_len))
    out = []
    for name, overrides in options:
        fields = {k: (v.format(bf=bf) if isinstance(v, str) else v) for k, v in overrides.items()}
        if fields.get("mode") == "infer":
            fields.update(prompt_len=seq_len, new_tokens=new)
        label = name.format(bf=bf)
        if fields.get("technique") in ("lora", "qlora") and not a.lora_default_targets:
            # peft has no default targets for this model type (LoraConfig would raise): the row shows the common
            # choice, every Linear, instead of nothing
            fields["lora_targets"] = "all-linear"
            label += " (all-linear)"
        out.append((label, Setup(batch_size=1, seq_len=seq_len, padded=padded, **fields)))
    return out


def largest_fitting(fits: Callable[[int], bool], cap: int) -> int:
    """Largest b in [1, cap] with fits(b), for a monotone `fits`; 0 if none. Doubling from 1, then bisection:
    about 2 log2(b) probes."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:  # invariant: lo fits, hi does not (or is beyond the cap)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_batch_size(spec, setup: Setup, budget_bytes: int, estimator: Callable, limit: int = 4096) -> int:
    """Largest batch whose need (memplan.planner.budget.need_bytes) is within `budget_bytes` (the estimate is
    monotone in batch size - a property the tests check). 0 when batch 1 does not fit."""
    return largest_fitting(
        lambda b: fits(estimator(spec, dataclasses.replace(setup, batch_size=b)), budget_bytes), limit)


def scale_out(spec, gpu: Gpu, seq_len: int, estimator: Callable, num_gpus: int | None = None,
              headroom: float = DEFAULT_HEADROOM) -> list[ScaleOutRow]:
    """Each SCALE_OUT_OPTIONS row: the fewest GPUs in GPU_COUNTS that fit micro-batch 1 (or exactly `num_gpus`),
    with what each GPU needs and the largest micro-batch there. Per-GPU memory never grows with the GPU count for a
    sharded engine, so the first count that fits is the fewest."""
    budget = _budget.budget_bytes(gpu.memory_bytes, headroom)
    rows = []
    counts = (num_gpus,) if num_gpus else GPU_COUNTS
    for name, setup in option_setups(spec, gpu, seq_len, SCALE_OUT_OPTIONS):
        found, tried, est = 0, setup, None
        try:
            for n in counts:
                tried = dataclasses.replace(setup, **gpu_layout(n))
                est = estimator(spec, tried)
                if fits(est, budget):
                    found = n
                    break
                if setup.sharding == "ddp" and n >= 2:
                    break  # replicas: more GPUs never lower the per-GPU memory
        except MemplanError as e:
            rows.append(ScaleOutRow(name, setup, 0, 0, 0, 0, str(e)))
            continue
        best = max_batch_size(spec, tried, budget, estimator) if found else 0
        rows.append(ScaleOutRow(name, tried, found, need_bytes(est), est.host_bytes * tried.num_gpus, best))
    return rows


def fit(spec, gpu: Gpu, seq_len: int = 512, estimator: Callable | None = None,
        num_gpus: int | None = None, headroom: float = DEFAULT_HEADROOM) -> FitResult:
    """Evaluate every FIT_OPTIONS row for `spec` on one `gpu` at `seq_len`, and the SCALE_OUT_OPTIONS rows across
    the fewest such GPUs (or `num_gpus` of them), against the budget that keeps `headroom` of the memory spare."""
    if estimator is None:
        estimator = estimator_for(gpu)
    budget = _budget.budget_bytes(gpu.memory_bytes, headroom)
    rows = []
    for name, setup in option_setups(spec, gpu, seq_len):
        try:
            est = estimator(spec, setup)
        except MemplanError as e:
            rows.append(FitRow(name, setup, False, 0, 0, 0, None, str(e)))
            continue
        need = need_bytes(est)
        best = max_batch_size(spec, setup, budget, estimator) if fits(est, budget) else 0
        rows.append(FitRow(name, setup, best > 0, best, need, max(0, need - budget), est))
    multi = [] if spec.checkpoint_quant in PREQUANTIZED else scale_out(spec, gpu, seq_len, estimator, num_gpus,
                                                                        headroom)
    return FitResult(spec.model_id, gpu, seq_len, tuple(rows), tuple(multi), num_gpus, headroom, budget)
