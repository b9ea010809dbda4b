"""MemoryCallback: check a real training run's memory against memplan's prediction, live.

A transformers TrainerCallback (also usable from a plain loop: call `step()` and `finish()` yourself). At each
logging step it records torch.cuda.max_memory_allocated / max_memory_reserved and NVML used memory, adds them with
the prediction to the Trainer's logs (so TensorBoard / W&B receive them as memplan/* scalars), warns once when the
measured allocated peak exceeds the prediction by more than `tolerance`, and once when the device comes within 5% of
the card's memory. At the end it appends a row in the validator's CSV format (memplan.measure.rows), so real training
runs feed `memplan check`. Without CUDA (a CPU run) there is nothing to measure: the fields are logged as absent and
the row is written with status "ok" and no measured bytes only when `cpu_row=True` (tests).
"""
from __future__ import annotations

import warnings
from pathlib import Path

from memplan.setup import Setup
from memplan.estimator.breakdown import estimate
from memplan.measure.rows import append_row, environment, make_row

try:  # a TrainerCallback when transformers is installed (always, with memplan's dependencies)
    from transformers import TrainerCallback as _Base
except ImportError:  # pragma: no cover
    _Base = object

LIMIT_MARGIN = 0.05


class MemoryCallback(_Base):
    """model: catalog id or config.json path (what memplan estimates); setup: the Setup this run uses (e.g. a
    plan file's, `memplan.load_plan(path).setup`); out: CSV to append the final row to (None: no row)."""

    def __init__(self, model: str, setup: Setup, out: str | Path | None = None, tolerance: float = 0.05,
                 card_bytes: int | None = None, source: str = "memplan.measure.callbacks.MemoryCallback"):
        self.model, self.setup, self.out, self.tolerance, self.source = model, setup, out, tolerance, source
        self.estimate = estimate(model, setup)
        self.card_bytes = card_bytes
        self.peak_allocated = self.peak_requested = self.peak_reserved = self.peak_device = 0
        self.warned: set[str] = set()
        self.rows_written = 0
        self._nvml = None
        self._baseline = None

    # ------------------------------------------------------------------------------------------ measuring

    def _cuda(self) -> bool:
        import torch
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _nvml_used(self) -> int | None:
        try:
            import pynvml
            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml.nvmlDeviceGetHandleByIndex(0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used)
        except Exception:  # no NVML: device memory is not reported
            return None

    def sample(self) -> dict[str, float | None]:
        """Current peaks (bytes) and the prediction; warns once per kind of problem."""
        if self._cuda():
            import torch
            self.peak_allocated = max(self.peak_allocated, torch.cuda.max_memory_allocated())
            # the tensors' own bytes (torch >= 2.1); allocated also counts blocks the allocator handed out unsplit
            requested = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)
            self.peak_requested = max(self.peak_requested, requested)
            self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())
            if self.card_bytes is None:
                self.card_bytes = torch.cuda.get_device_properties(0).total_memory
            used = self._nvml_used()
            if used is not None:
                self.peak_device = max(self.peak_device, used)
        pred = self.estimate.peak_allocated_bytes
        fields = {"memplan/peak_allocated_bytes": self.peak_allocated or None,
                  "memplan/peak_reserved_bytes": self.peak_reserved or None,
                  "memplan/device_used_bytes": self.peak_device or None,
                  "memplan/predicted_allocated_bytes": pred,
                  "memplan/predicted_device_bytes": self.estimate.device_total_bytes}
        if self.peak_allocated:
            err = (self.peak_allocated - pred) / pred
            fields["memplan/allocated_vs_prediction"] = err
            if err > self.tolerance:
                self._warn("over", f"memplan: measured peak allocated {self.peak_allocated / 2**30:.2f} GiB exceeds "
                                   f"the prediction {pred / 2**30:.2f} GiB by {err:.1%} (tolerance "
                                   f"{self.tolerance:.0%}); please report it with `memplan check`")
        if self.card_bytes and self.peak_device and self.peak_device >= (1 - LIMIT_MARGIN) * self.card_bytes:
            self._warn("limit", f"memplan: the GPU is within {LIMIT_MARGIN:.0%} of its memory "
                                f"({self.peak_device / 2**30:.2f} of {self.card_bytes / 2**30:.2f} GiB): an OOM is "
                                "near; `memplan doctor` lists remedies")
        return fields

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------------------------------ plain loop API

    def step(self) -> dict[str, float | None]:
        """Plain loops: call after each optimizer step (or each logging step)."""
        return self.sample()

    def finish(self, status: str = "ok", error: str = "", cpu_row: bool = False) -> dict | None:
        """Append the run's row to `out` (validator CSV format); returns it (None when nothing was measured)."""
        self.sample()
        if self.out is None or (not self.peak_allocated and not cpu_row):
            return None
        from datetime import datetime, timezone

        device = "cuda" if self.peak_allocated else "cpu"
        row = make_row(self.model, self.setup, status=status, error=error, device=device,
                       measured_allocated_bytes=self.peak_allocated or None,
                       measured_requested_bytes=self.peak_requested or None,
                       measured_reserved_bytes=self.peak_reserved or None,
                       measured_device_bytes=self.peak_device or None, source=self.source,
                       measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       notes="measured during a real training run", **environment(device))
        append_row(self.out, row)
        self.rows_written += 1
        return row

    # ------------------------------------------------------------------------------------------ Trainer hooks

    def attach(self, trainer) -> "MemoryCallback":
        """Put this callback first in the trainer's callbacks, so the reporting callbacks (TensorBoard, W&B, ...)
        that run after it receive the memplan/* fields in the same logs. (Passed as `callbacks=[cb]`, it runs after
        them: the fields still reach trainer.state.log_history and the final row.)"""
        handler = trainer.callback_handler
        handler.callbacks = [self] + [c for c in handler.callbacks if c is not self]
        return self

    def on_log(self, args, state, control, logs=None, **kwargs):
        fields = {k: v for k, v in self.sample().items() if v is not None}
        if logs is not None:
            logs.update(fields)
        if state.log_history:  # Trainer.log appended its copy of logs before calling the callbacks
            state.log_history[-1].update(fields)

    def on_train_end(self, args, state, control, **kwargs):
        self.finish(cpu_row=getattr(self, "cpu_row", False))
