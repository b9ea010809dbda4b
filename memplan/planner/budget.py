"""The one fit test that fit, plan, doctor and plot share: a setup fits a GPU when what it needs is within the budget.

    usable = GPU memory - CUDA context (memory.overhead.CUDA_CONTEXT_BYTES)
    budget = GPU memory - headroom x usable               (default 3.5%)
    need   = peak allocated + largest tensor + device-only memory    (Estimate.cap_need_bytes)
             + with checkpointing, the split cache a capped allocator cannot free (overhead.CAP_FRAGMENTATION_CKPT)

The device total (reserved + device-only) is what an uncapped run shows in nvidia-smi; it is not the limit, because
under a full card the caching allocator frees its cache and retries before it reports an OOM. docs/PLANNER.md
("Budget") has the measured runs behind both definitions and the default headroom.
"""
from __future__ import annotations

from memplan.estimator.memory.overhead import CUDA_CONTEXT_BYTES

#: memory kept spare, as a fraction of the usable memory (measured planner runs: docs/PLANNER.md "Budget")
DEFAULT_HEADROOM = 0.035
#: plan --replay's default: the caching-allocator replay's reserved peak was within 1.1% of the GPU's on every
#: capped run it was checked on (benchmarks/results/allocator_replay.md), so 1% spare replaces the 3.5% the closed
#: form's bound needs
REPLAY_HEADROOM = 0.01


def split(memory_bytes: int, headroom: float = DEFAULT_HEADROOM) -> tuple[int, int, int]:
    """The budget of a GPU with `memory_bytes` and its parts (module docstring).

    Returns:
        (usable, headroom bytes, budget)."""
    usable = max(0, memory_bytes - CUDA_CONTEXT_BYTES)
    reserve = int(usable * headroom)
    return usable, reserve, memory_bytes - reserve


def budget_bytes(memory_bytes: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """What a setup's need may reach on a GPU with `memory_bytes`."""
    return split(memory_bytes, headroom)[2]


def need_bytes(est) -> int:
    """What a setup needs from the GPU (Estimate.cap_need_bytes)."""
    return est.cap_need_bytes


def need_terms(est) -> str:
    """What need_bytes(est) adds up, in words (plan, estimate and doctor print it)."""
    split = " + split cache (checkpointing)" if est.cap_fragmentation_bytes else ""
    return f"peak allocated + largest tensor{split} + memory outside the allocator"


def fits(est, budget: int) -> bool:
    """The fit test: the setup's need is within `budget` (fit, plan, doctor and plot all call this)."""
    return need_bytes(est) <= budget
