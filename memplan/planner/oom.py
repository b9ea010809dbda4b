"""Reading a pasted PyTorch CUDA out-of-memory message: the card's capacity and what the run held when it failed
(memplan doctor --oom-message / --oom-file)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from memplan.errors import BadInput
from memplan.units import GiB, KiB, MiB

_UNITS = {"b": 1, "byte": 1, "bytes": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}
_SIZE = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB)\b"
_FIELDS = {  # field -> patterns: the current message (torch >= 2.1) first, then the older "(GPU 0; ...)" form
    "tried_to_allocate_bytes": (r"Tried to allocate " + _SIZE,),
    "total_capacity_bytes": (r"total capac\w* of " + _SIZE, _SIZE + r" total capac"),
    "free_bytes": (r"of which " + _SIZE + r" is free", _SIZE + r" free\b"),
    "allocated_by_pytorch_bytes": (_SIZE + r" is allocated by PyTorch", _SIZE + r" already allocated"),
    "reserved_unallocated_bytes": (_SIZE + r" is reserved by PyTorch but unallocated",),
    "process_in_use_bytes": (r"this process has " + _SIZE + r" memory in use",),
}


@dataclass(frozen=True, slots=True)
class OomInfo:
    """The numbers of a PyTorch CUDA out-of-memory message, in bytes (None where the message has none)."""

    tried_to_allocate_bytes: int | None = None
    total_capacity_bytes: int | None = None
    free_bytes: int | None = None
    allocated_by_pytorch_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_in_use_bytes: int | None = None
    gpu_index: int | None = None
    other_processes_bytes: int | None = None  # "Process N has X memory in use" lines (other processes)

    @property
    def reserved_by_pytorch_bytes(self) -> int | None:
        if self.allocated_by_pytorch_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_by_pytorch_bytes + self.reserved_unallocated_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bytes(number: str, unit: str) -> int:
    return int(round(float(number.replace(",", "")) * _UNITS[unit.lower()]))


def parse_oom_message(text: str) -> OomInfo:
    """Read a pasted `torch.OutOfMemoryError` (current or pre-2.1 wording, wrapped lines allowed). Raises BadInput
    when the text is not one."""
    flat = " ".join(str(text).split())
    if not re.search(r"out of memory", flat, re.IGNORECASE) or not re.search(r"Tried to allocate " + _SIZE, flat):
        raise BadInput("not a PyTorch out-of-memory message: expected text like 'CUDA out of memory. Tried to "
                       "allocate 20.00 MiB ...' (paste the whole torch.OutOfMemoryError line)")
    found: dict = {}
    for name, patterns in _FIELDS.items():
        for p in patterns:
            m = re.search(p, flat)
            if m:
                found[name] = _bytes(m.group(1), m.group(2))
                break
    old_reserved = re.search(_SIZE + r" reserved in total by PyTorch", flat)
    if old_reserved and "allocated_by_pytorch_bytes" in found:
        reserved = _bytes(*old_reserved.groups())
        found["reserved_unallocated_bytes"] = max(0, reserved - found["allocated_by_pytorch_bytes"])
    gpu = re.search(r"\bGPU (\d+)", flat)
    others = [_bytes(n, u) for n, u in re.findall(r"Process \d+ has " + _SIZE + r" memory in use", flat)]
    return OomInfo(gpu_index=int(gpu.group(1)) if gpu else None,
                   other_processes_bytes=sum(others) if others else None, **found)

