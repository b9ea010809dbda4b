"""memplan: GPU memory planning for fine-tuning and serving Hugging Face transformers.

Public API (lazy imports keep `import memplan` torch-free and fast): estimate, Estimate, frame, Setup, fit, load_spec,
ModelSpec, find_gpu, resolve_gpu, plan, Plan, load_plan, write_plan, validate, check, diagnose, trace,
MemoryCallback. The parts live in subpackages named as nouns (model, inventory, estimator, runtime, tracer, replay,
planner, measure, cli), so that no submodule shadows these functions; CONTRIBUTING.md maps them.
"""
from __future__ import annotations

from importlib import import_module

__version__ = "0.2.0"

_EXPORTS = {
    "estimate": "memplan.estimator.breakdown", "Estimate": "memplan.estimator.breakdown",
    "frame": "memplan.estimator.breakdown", "Setup": "memplan.setup",
    "fit": "memplan.planner.fit_table", "load_spec": "memplan.model.catalog", "ModelSpec": "memplan.model.spec",
    "find_gpu": "memplan.gpus", "resolve_gpu": "memplan.gpus", "plan": "memplan.planner.search",
    "Plan": "memplan.planner.types", "load_plan": "memplan.planner.export", "write_plan": "memplan.planner.export",
    "validate": "memplan.measure.runner", "check": "memplan.measure.gate", "diagnose": "memplan.planner.doctor",
    "trace": "memplan.tracer.training", "MemoryCallback": "memplan.measure.callbacks",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
