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


def _callable_module(module_name: str, func) -> None:
    """Python binds a loaded submodule over the package's same-named lazy export: once anything imports
    memplan.estimate (the module), `memplan.estimate` is that module, not the function. The submodules named after
    their function (estimate, fit, validate, check) therefore forward calls to it, so `memplan.estimate(...)`
    works whatever was imported first."""
    import sys
    import types

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return func(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
