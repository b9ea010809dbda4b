"""What a validation run measures (Measurement) and how it is read on CUDA (CudaMeter: torch.cuda's allocator
statistics per phase, NVML device samples, the memory cap that emulates a smaller card). memplan.measure.runner runs
the steps in a subprocess and reports a Measurement; the module docstring there defines each figure."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from memplan.errors import BadInput


@dataclass
class Measurement:
    """What one run measured. Bytes; None where not measured (reserved/device on the CPU)."""

    status: str  # ok | oom | error
    device: str
    steps: int
    allocated_bytes: int | None = None
    requested_bytes: int | None = None
    reserved_bytes: int | None = None
    device_bytes: int | None = None
    cuda_context_bytes: int | None = None
    phase_allocated: dict[str, int] = field(default_factory=dict)
    peak_phase: str = ""
    alloc_retries: int | None = None
    num_ooms: int | None = None
    memory_fraction: float | None = None
    memory_limit_bytes: int | None = None
    error: str = ""
    environment: dict[str, str] = field(default_factory=dict)

    def row_values(self) -> dict:
        """The measured-row columns (memplan.measure.rows.COLUMNS) this measurement fills."""
        return {"status": self.status, "error": self.error, "device": self.device, "steps": self.steps,
                "measured_allocated_bytes": self.allocated_bytes, "measured_requested_bytes": self.requested_bytes,
                "measured_reserved_bytes": self.reserved_bytes,
                "measured_device_bytes": self.device_bytes, "cuda_context_bytes": self.cuda_context_bytes,
                "peak_phase": self.peak_phase, "phase_allocated": self.phase_allocated or None,
                "alloc_retries": self.alloc_retries, "num_ooms": self.num_ooms,
                "memory_fraction": self.memory_fraction, "memory_limit_bytes": self.memory_limit_bytes,
                **self.environment}


class CudaMeter:
    """Per-phase peaks from torch.cuda's allocator statistics and NVML device samples."""

    def __init__(self, memory_fraction: float | None = None, emulate_bytes: int | None = None,
                 shared_gpu: bool = False):
        import torch
        self.torch = torch
        # on a GPU shared with other runs NVML's used memory is everyone's: no device-level figures then
        self.nvml = None if shared_gpu else _nvml_handle()
        baseline = self._nvml_used()
        torch.cuda.init()
        torch.cuda.set_device(0)
        self.baseline = baseline
        self.context = (self._nvml_used() - baseline) if baseline is not None else None
        self.total = torch.cuda.get_device_properties(0).total_memory
        self.fraction, self.limit = memory_fraction, None
        if emulate_bytes is not None:
            self.limit = emulate_bytes - (self.context or 0)
            if self.limit <= 0:
                raise BadInput("the emulated memory is smaller than the CUDA context")
            self.fraction = min(1.0, self.limit / self.total)
        elif memory_fraction is not None:
            self.limit = int(memory_fraction * self.total)
        if self.fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self.fraction, 0)
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self.requested_peak: int | None = None  # requested_bytes.all.peak (torch >= 2.1) over the phases
        self.reserved_peak = 0
        self.device_peak = 0

    def _nvml_used(self) -> int | None:
        if self.nvml is None:
            return None
        import pynvml
        return int(pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used)

    def start(self) -> None:
        """After the build: drop the build's cached blocks and start the peaks from the resident weights."""
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats()

    def enter(self, phase: str) -> None:
        cuda = self.torch.cuda
        if self.phase not in ("setup", "between"):
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), cuda.max_memory_allocated())
            requested = cuda.memory_stats().get("requested_bytes.all.peak")
            if requested is not None:
                self.requested_peak = max(self.requested_peak or 0, requested)
        self.reserved_peak = max(self.reserved_peak, cuda.max_memory_reserved())
        used = self._nvml_used()
        if used is not None and self.baseline is not None:
            self.device_peak = max(self.device_peak, used - self.baseline)
        cuda.reset_peak_memory_stats()
        self.phase = phase

    def result(self, status: str, steps: int, error: str = "") -> Measurement:
        self.enter("between")
        stats = self.torch.cuda.memory_stats()
        peak_phase = max(self.phase_peaks, key=self.phase_peaks.get) if self.phase_peaks else ""
        return Measurement(status=status, device="cuda", steps=steps,
                           allocated_bytes=max(self.phase_peaks.values(), default=None),
                           requested_bytes=self.requested_peak,
                           reserved_bytes=self.reserved_peak, device_bytes=self.device_peak or None,
                           cuda_context_bytes=self.context, phase_allocated=dict(self.phase_peaks),
                           peak_phase=peak_phase, alloc_retries=stats.get("num_alloc_retries"),
                           num_ooms=stats.get("num_ooms"), memory_fraction=self.fraction,
                           memory_limit_bytes=self.limit, error=error)


def _nvml_handle():
    try:
        import pynvml
        pynvml.nvmlInit()
        index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # NVML missing or the index is a UUID: no device-level figures
        return None
