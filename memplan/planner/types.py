"""What the planner returns: the evaluated candidates, the alternatives it reports and the Plan (memplan.planner.search
finds them; memplan.planner.explain words the alternatives; memplan.planner.export and the CLI write the Plan)."""
from __future__ import annotations

from dataclasses import dataclass, field

from memplan.planner.budget import need_bytes
from memplan.gpus import Gpu
from memplan.setup import Setup


@dataclass(frozen=True, slots=True)
class Candidate:
    """One evaluated point: a Setup at its chosen micro-batch, its estimate, and whether it fits the budget."""

    setup: Setup
    estimate: object  # Estimate (at setup.batch_size; at batch 1 when nothing fits)
    fits: bool
    max_batch_size: int
    key: tuple = ()

    @property
    def need_bytes(self) -> int:
        """What it needs from the GPU (memplan.planner.budget.need_bytes)."""
        return need_bytes(self.estimate)


@dataclass(frozen=True, slots=True)
class Alternative:
    setup: Setup
    fits: bool
    need_bytes: int  # memplan.planner.budget.need_bytes of its estimate
    reason: str

    def to_dict(self) -> dict:
        return {"setup": self.setup.to_dict(), "fits": self.fits, "need_bytes": self.need_bytes,
                "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Plan:
    """The chosen setup (None when nothing fits), its estimate and the memory budget it was chosen against.

    usable_bytes = GPU memory - CUDA context; headroom_bytes = headroom x usable; budget_bytes (what the chosen
    setup's need may reach: memplan.planner.budget) = GPU memory - headroom_bytes.
    """

    model: str
    gpu: Gpu
    prefer: str
    effective_batch: int
    headroom: float
    usable_bytes: int
    headroom_bytes: int
    budget_bytes: int
    setup: Setup | None
    estimate: object | None
    alternatives: tuple[Alternative, ...] = ()
    evaluated: int = 0  # estimates computed
    pinned: dict = field(default_factory=dict)
    smallest: Alternative | None = None  # nothing fits: the setup needing the least memory
    suggestions: tuple[str, ...] = ()  # nothing fits: what would make it fit
    replay: dict = field(default_factory=dict)  # plan --replay: the allocator replays behind the micro-batch

    @property
    def fits(self) -> bool:
        return self.setup is not None

    @property
    def achieved_effective_batch(self) -> int:
        return self.setup.batch_size * self.setup.grad_accum * self.setup.world_size if self.setup else 0

    @property
    def spare_bytes(self) -> int:
        """Budget left at the setup's need, beyond the headroom (what doctor calls spare too)."""
        return self.budget_bytes - need_bytes(self.estimate) if self.estimate else 0

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "prefer": self.prefer, "fits": self.fits, "effective_batch": self.effective_batch,
            "achieved_effective_batch": self.achieved_effective_batch,
            "headroom": self.headroom, "usable_bytes": self.usable_bytes, "headroom_bytes": self.headroom_bytes,
            "budget_bytes": self.budget_bytes, "spare_bytes": self.spare_bytes, "pinned": _jsonable(self.pinned),
            "setup": self.setup.to_dict() if self.setup else None,
            "estimate": self.estimate.to_dict() if self.estimate else None,
            "alternatives": [a.to_dict() for a in self.alternatives],
            "smallest": self.smallest.to_dict() if self.smallest else None,
            "suggestions": list(self.suggestions), "evaluated": self.evaluated,
            "replay": self.replay or None,
        }


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
