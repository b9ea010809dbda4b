"""`plan --mode infer`: which checkpoint format serves the model on the card, and at what batch.

The formats in the order a user gives up fidelity (16-bit, FP8, 8-bit, 4-bit), each with the largest batch that fits
at the prompt and generation lengths asked; the plan is the first that serves the batch asked for (issue 40: "the
AWQ checkpoint fits at batch 8 where bf16 does not"). A pre-quantized upload is served as stored only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.estimator.breakdown import estimator_for
from memplan.estimator.memory.context import fp8_dequantized
from memplan.gpus import Gpu, assume_gpu
from memplan.planner import budget as _budget
from memplan.planner.budget import DEFAULT_HEADROOM, need_bytes
from memplan.planner.fit_table import max_batch_size
from memplan.setup import Setup

#: (what to load, Setup.quant), most faithful first. FP8 needs compute capability 8.9 (below it transformers
#: dequantizes: the 16-bit row again, left out); the 4-bit uploads before bitsandbytes on load, which holds the
#: 16-bit checkpoint's download and quantizes it at load time
SERVING_FORMATS: tuple[tuple[str, str | None], ...] = (
    ("the 16-bit checkpoint", None),
    ("an FP8 upload (-FP8, 128 x 128 block scales)", "fp8"),
    ("an 8-bit GPTQ upload (-GPTQ-Int8)", "gptq-int8"),
    ("a 4-bit AWQ upload (-AWQ)", "awq"),
    ("a 4-bit GPTQ upload (-GPTQ-Int4)", "gptq-int4"),
    ("the 16-bit checkpoint quantized on load (bitsandbytes nf4)", "nf4"),
)


@dataclass(frozen=True)
class ServingRow:
    option: str
    setup: Setup
    max_batch: int  # 0: batch 1 does not fit
    need_bytes: int  # at the batch asked for
    error: str = ""

    def to_dict(self) -> dict:
        return {"option": self.option, "quant": self.setup.quant, "max_batch": self.max_batch,
                "need_bytes": self.need_bytes, "setup": self.setup.to_dict(), "error": self.error or None}


@dataclass(frozen=True)
class ServingPlan:
    model: str
    gpu: Gpu
    batch_size: int
    rows: tuple[ServingRow, ...]
    budget_bytes: int

    @property
    def choice(self) -> ServingRow | None:
        """The most faithful format that serves the batch asked for."""
        return next((r for r in self.rows if r.max_batch >= self.batch_size), None)

    @property
    def fits(self) -> bool:
        return self.choice is not None

    def to_dict(self) -> dict:
        c = self.choice
        return {"model": self.model, "gpu": self.gpu.name, "batch_size": self.batch_size,
                "budget_bytes": self.budget_bytes, "fits": self.fits, "choice": c.to_dict() if c else None,
                "options": [r.to_dict() for r in self.rows]}


def _formats(spec, gpu: Gpu) -> tuple[tuple[str, str | None], ...]:
    if spec.checkpoint_quant:  # an upload loads as stored
        return ((f"{spec.model_id} as stored ({spec.checkpoint_quant})", spec.checkpoint_quant),)
    with assume_gpu(gpu):  # a known card that runs FP8 kernels (context.FP8_KERNELS_FROM)
        fp8 = bool(gpu.compute_capability) and not fp8_dequantized()
    rows = tuple((label, q) for label, q in SERVING_FORMATS if q != "fp8" or fp8)
    if spec.fused_experts:  # a quantized upload's fused experts are not modelled: the 16-bit checkpoint alone
        rows = rows[:1]
    if spec.arch.model_type == "gpt_oss":  # released with MXFP4 experts: that checkpoint first
        rows = (("the released checkpoint (MXFP4 experts)", "mxfp4"),) + rows
    return rows


def plan_serving(spec, gpu: Gpu, base: Setup, headroom: float = DEFAULT_HEADROOM,
                 estimator: Callable | None = None) -> ServingPlan:
    """Each serving format's largest batch on `gpu` at `base`'s prompt and generation lengths, and its need at
    `base.batch_size`. AWQ computes in fp16 (transformers casts it so on CUDA); the others in `base`'s precision."""
    estimator = estimator or estimator_for(gpu)
    budget = _budget.budget_bytes(gpu.memory_bytes, headroom)
    rows = []
    for label, quant in _formats(spec, gpu):
        precision = "fp16" if quant == "awq" else base.precision
        try:
            setup = dataclasses.replace(base, quant=quant, precision=precision, double_quant=quant == "nf4")
            est = estimator(spec, setup)
        except MemplanError as e:
            rows.append(ServingRow(label, base, 0, 0, str(e)))
            continue
        best = max_batch_size(spec, setup, budget, estimator)  # 0 where batch 1 does not fit
        rows.append(ServingRow(label, setup, best, need_bytes(est)))
    return ServingPlan(spec.model_id, gpu, base.batch_size, tuple(rows), budget)
