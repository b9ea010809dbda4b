"""check: re-estimate every stored measurement with the current estimator; the CI gate against drift.

For each row (memplan.measure.rows schema) the setup is rebuilt from its columns and estimated again. A row fails when
  - its status is ok and |predicted - measured| / measured exceeds its tolerance (the row's own `tolerance` column,
    else the command's), for the quantity compared: `measure` (allocated, reserved or device) when the row has it,
    else the first of allocated, reserved, device that it has;
  - its status is oom and the estimate says it fits: for rows run under a cap, the allocator need
    (Estimate.allocator_need_bytes: live peak, a fresh block for the largest tensor, the split cache under
    checkpointing) more than the tolerance below the cap (memory_limit_bytes); else predicted device total below
    the GPU's memory (gpu_memory_bytes);
  - it can no longer be estimated (unknown model, a setup the estimator now refuses).
Rows with gate=no are reported and never fail; rows with status error are listed as not checked.
CPU rows (device=cpu, the tracer's accounting) are compared with the estimate less what only CUDA allocates
(the cuBLAS workspace; memplan.tracer.training.comparable_estimate_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memplan import libs
from memplan.gpus import assume_gpu
from memplan.measure.rows import QUANTITIES, int_or_none, measured_files, read_rows, setup_from_row
from memplan.units import GiB
from memplan.errors import MemplanError, BadInput
from memplan.tracer.training import comparable_estimate_bytes
from memplan.estimator import breakdown

DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class CheckRow:
    file: str
    key: str
    model: str
    label: str
    status: str  # the row's measured status
    quantity: str
    measured_bytes: int | None
    predicted_bytes: int | None
    tolerance: float
    gated: bool
    verdict: str  # pass | fail | info | skip
    reason: str = ""

    @property
    def rel_error(self) -> float | None:
        if self.measured_bytes and self.predicted_bytes is not None:
            return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes
        return None


@dataclass(frozen=True, slots=True)
class CheckResult:
    rows: tuple[CheckRow, ...]
    tolerance: float

    @property
    def failures(self) -> tuple[CheckRow, ...]:
        return tuple(r for r in self.rows if r.verdict == "fail")

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_frame(self):
        """Every row as a pandas DataFrame, worst first (CheckRow's fields)."""
        import dataclasses
        import pandas as pd
        return pd.DataFrame([dataclasses.asdict(r) for r in self.worst_first()])

    def worst_first(self) -> list[CheckRow]:
        """Failures, then informational rows, then passes, worst error first; a pass on a measured OOM (the
        prediction above the cap: no error to rank) after the measured passes."""
        order = {"fail": 0, "info": 1, "pass": 2, "skip": 3}
        return sorted(self.rows, key=lambda r: (order[r.verdict], r.verdict == "pass" and r.status == "oom",
                                                -abs(r.rel_error or 0)))


def row_label(row: dict) -> str:
    s = setup_from_row(row)
    parts = [s.mode, s.technique, s.precision] + ([s.quant] if s.quant else []) + [s.optimizer] * (s.mode == "train")
    parts += [f"b{s.batch_size}", f"s{s.seq_len}"] + (["ckpt"] if s.grad_ckpt else []) + ([s.attn_impl] if s.attn_impl else [])
    parts += ["padded"] if s.padded else []
    parts += (["dora"] if s.use_dora else []) + (["liger"] if s.use_liger_kernel else [])
    if s.added_tokens:
        parts.append(f"+{s.added_tokens} tokens" + (f" ({s.train_new_tokens})" if s.train_new_tokens else ""))
    if s.uses_lora:
        parts.insert(2, f"r{s.lora_r}" + (" all-linear" if s.lora_targets == "all-linear" else ""))
    if s.trainer != "hf":  # TRL's trainer and what changes its step (two rows differing only there read apart)
        parts.insert(1, s.trainer)
        parts += [word for on, word in ((s.packing, "packed"), (s.padding_free, "padding-free"),
                                        (s.activation_offloading, "offloading"),
                                        (s.precompute_ref_log_probs, "precomputed reference"),
                                        (s.grad_accum > 1, f"accumulation {s.grad_accum}")) if on]
        if s.trainer == "grpo":
            parts.append(f"{s.num_generations} generations x {s.max_completion_length}")
    return " ".join(parts)


def _tolerance(row: dict, default: float) -> float:
    text = (row.get("tolerance") or "").strip()
    return float(text.rstrip("%")) / 100 if text.endswith("%") else float(text) if text else default


def _predicted(est, quantity: str, device: str) -> int:
    if quantity == "allocated":
        if device == "cpu":
            return comparable_estimate_bytes(est)
        return est.peak_allocated_bytes
    return est.peak_reserved_bytes if quantity == "reserved" else est.device_total_bytes


def estimate_row(row: dict, estimator=None):
    """The estimate of a stored row's setup as it ran: under the transformers and peft releases and the GPU it
    recorded (memplan.libs.assume, gpus.assume_gpu), so rows of several releases stay comparable. estimator: the
    function to call (memplan.estimator.breakdown.estimate by default)."""
    estimator = estimator or breakdown.estimate
    with libs.assume(transformers=row.get("transformers"), peft=row.get("peft"), memplan=row.get("memplan")), \
            assume_gpu(row.get("gpu") or None):
        return estimator(row["model"], setup_from_row(row))


def check_row(row: dict, file: str, tolerance: float, measure: str, estimator) -> CheckRow:
    """The verdict on one stored row."""
    gated = (row.get("gate") or "yes").strip().lower() not in ("no", "false", "0")
    tol = _tolerance(row, tolerance)
    status = (row.get("status") or "ok").strip()
    base = dict(file=file, key=row.get("key", ""), model=row["model"], status=status, tolerance=tol, gated=gated)
    try:
        label = row_label(row)
        est = estimate_row(row, estimator)
    except MemplanError as e:
        return CheckRow(label=row.get("technique", ""), quantity="", measured_bytes=None, predicted_bytes=None,
                        verdict="fail" if gated else "info", reason=f"cannot estimate: {str(e).splitlines()[0]}",
                        **base)
    device = (row.get("device") or "cuda").strip()
    if status == "error":
        return CheckRow(label=label, quantity="", measured_bytes=None, predicted_bytes=None, verdict="skip",
                        reason=f"not checked: the run failed ({row.get('error', '')[:80]})", **base)
    if status == "oom":
        limit = int_or_none(row.get("memory_limit_bytes"))
        quantity = "reserved" if limit else "device"
        limit = limit or int_or_none(row.get("gpu_memory_bytes"))
        if limit is None:
            return CheckRow(label=label, quantity=quantity, measured_bytes=None, predicted_bytes=None,
                            verdict="skip", reason="oom row without memory_limit_bytes or gpu_memory_bytes", **base)
        if quantity == "reserved":
            # under an allocator cap the cache is elastic (freed and retried before an OOM): what must fit is the
            # live peak plus one fresh block for the largest tensor, and with checkpointing the split cache
            # (Estimate.allocator_need_bytes, docs/PLANNER.md)
            quantity = "allocated + largest tensor"
            pred = est.allocator_need_bytes
        else:
            pred = _predicted(est, quantity, device)
        # the real need is above the limit: a prediction within the row's tolerance below it is as close as an ok
        # row's |error| <= tolerance
        wrong = pred < limit * (1 - tol)
        verdict = ("fail" if gated else "info") if wrong else "pass"
        reason = (f"measured OOM but predicted to fit: {pred / GiB:.2f} GiB {quantity} < limit {limit / GiB:.2f} GiB "
                  f"less {tol:.0%}" if wrong else
                  f"OOM predicted: {pred / GiB:.2f} GiB {quantity} vs limit {limit / GiB:.2f} GiB")
        return CheckRow(label=label, quantity=f"oom ({quantity})", measured_bytes=limit, predicted_bytes=pred,
                        verdict=verdict, reason=reason, **base)
    have = {q: int_or_none(row.get(f"measured_{q}_bytes")) for q in QUANTITIES}
    quantity = measure if have.get(measure) else next((q for q in QUANTITIES if have[q]), None)
    if quantity is None:
        return CheckRow(label=label, quantity="", measured_bytes=None, predicted_bytes=None, verdict="skip",
                        reason="no measured quantity", **base)
    pred = _predicted(est, quantity, device)
    rel = (pred - have[quantity]) / have[quantity]
    within = abs(rel) <= tol
    verdict = "pass" if within else ("fail" if gated else "info")
    reason = "" if within else f"|error| {abs(rel):.1%} > tolerance {tol:.1%}"
    return CheckRow(label=label, quantity=quantity, measured_bytes=have[quantity], predicted_bytes=pred,
                    verdict=verdict, reason=reason, **base)


def check(paths, tolerance: float = DEFAULT_TOLERANCE, measure: str = "allocated", estimator=None) -> CheckResult:
    """Check every row of the CSV files named or found in the folders named."""
    estimator = estimator or breakdown.estimate
    if measure not in QUANTITIES:
        raise BadInput(f"measure must be one of {', '.join(QUANTITIES)}, got {measure!r}")
    out = []
    for f in measured_files(paths):
        for row in read_rows(f):
            try:
                out.append(check_row(row, str(f), tolerance, measure, estimator))
            except BadInput as e:  # a value the row cannot hold (NaN, text): the row fails, the others are checked
                out.append(CheckRow(file=str(f), key=row.get("key", ""), model=row.get("model", ""), label="",
                                    status=row.get("status", ""), quantity="", measured_bytes=None,
                                    predicted_bytes=None, tolerance=tolerance, gated=True, verdict="fail",
                                    reason=f"unreadable row: {e}"))
    return CheckResult(tuple(out), tolerance)


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GiB:.3f}"


def error_text(r: CheckRow) -> str:
    """The row's signed relative error, as the report and the console print it; for a measured OOM whether the
    estimate predicted it (the prediction against the cap is no error: the real need is above the cap)."""
    if r.status == "oom" and r.rel_error is not None:
        return "OOM predicted" if r.verdict == "pass" else f"{r.rel_error:+.1%} under cap"
    return "" if r.rel_error is None else f"{r.rel_error:+.1%}"


def summary(result: CheckResult) -> str:
    """One line: rows per verdict, the median |error| of the gated quantities, the default tolerance."""
    rows = result.rows
    counts = {v: sum(r.verdict == v for r in rows) for v in ("pass", "fail", "info", "skip")}
    errs = sorted(abs(r.rel_error) for r in rows if r.rel_error is not None and r.quantity in QUANTITIES)
    med = f"{errs[len(errs) // 2]:.1%}" if errs else "n/a"
    return (f"{len(rows)} rows: {counts['pass']} pass, {counts['fail']} fail, {counts['info']} informational, "
            f"{counts['skip']} not checked; median |error| {med}; default tolerance {result.tolerance:.1%}")


def markdown(result: CheckResult) -> str:
    """The report: summary line, then every row worst-first."""
    rows = result.worst_first()
    lines = [f"# memplan check: {'PASS' if result.ok else 'FAIL'}", "", summary(result), "",
             "| verdict | model | setup | quantity | measured GiB | predicted GiB | error | tolerance | note | file |",
             "|---|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r.verdict} | {r.model} | {r.label} | {r.quantity} | {_gib(r.measured_bytes)} | "
                     f"{_gib(r.predicted_bytes)} | {error_text(r)} | {r.tolerance:.0%} | {r.reason} | {Path(r.file).name} |")
    return "\n".join(lines) + "\n"
