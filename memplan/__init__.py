"""memplan: GPU memory planning for fine-tuning and serving Hugging Face transformers.

Public API (lazy imports keep `import memplan` torch-free and fast): estimate, Estimate, Setup, fit, load_spec,
ModelSpec, find_gpu, resolve_gpu, plan, Plan, load_plan, write_plan, validate, check, diagnose, MemoryCallback.
"""
from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "estimate": "memplan.estimate", "Estimate": "memplan.estimate", "Setup": "memplan.setup",
    "fit": "memplan.fit", "load_spec": "memplan.models", "ModelSpec": "memplan.spec",
    "find_gpu": "memplan.gpus", "resolve_gpu": "memplan.gpus", "plan": "memplan.search", "Plan": "memplan.search",
    "load_plan": "memplan.export", "write_plan": "memplan.export", "validate": "memplan.validate",
    "check": "memplan.check", "diagnose": "memplan.doctor", "MemoryCallback": "memplan.callbacks",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
