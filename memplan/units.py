"""Byte constants, dtype sizes and formatting. Bytes inside, GiB (2**30) at the edge.

Imports nothing from memplan.
"""
from __future__ import annotations

import re

KiB = 2**10
MiB = 2**20
GiB = 2**30
GB = 10**9

#: Bytes per element of each dtype name used across memplan (torch's element sizes).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "int64": 8,
    "nf4": 0.5,  # two 4-bit codes packed per uint8 (bitsandbytes Params4bit)
    "fp4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of `dtype` (one of DTYPE_BYTES)."""
    return DTYPE_BYTES[dtype]


def fmt_gib(n_bytes: float, digits: int = 2) -> str:
    """Format bytes as GiB, e.g. ``fmt_gib(3 * 2**30) == '3.00 GiB'``."""
    return f"{n_bytes / GiB:.{digits}f} GiB"


def fmt_count(n: int) -> str:
    """A parameter count the way model cards write it, 3 significant digits: ``fmt_count(6_738_415_616) == '6.74B'``,
    ``fmt_count(124_439_808) == '124M'``."""
    for scale, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        # rounded to 3 digits first: 999.9M is "1B" (it printed "1e+03M"), as a card would write it
        text = f"{n / scale:.3g}"
        if float(text) >= 1:
            return (text if "e" not in text else f"{n / scale:.0f}") + unit
    return str(n)


#: the largest memory size accepted (1 EiB): far past any machine, and within a float's exact integers' reach
MAX_SIZE = 2**60

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": GiB, "b": 1,
    "k": KiB, "kb": 10**3, "kib": KiB,
    "m": MiB, "mb": 10**6, "mib": MiB,
    "g": GiB, "gb": GB, "gib": GiB,
    "t": 2**40, "tb": 10**12, "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Parse a memory size: '12GiB', '12 GB' (10**9), '24g' (GiB), '16000MiB', a bare number = GiB.

    Raises ValueError with the accepted forms when the text is not a size.
    """
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    shown = repr(str(text)) if len(str(text)) <= 40 else repr(str(text)[:37] + "...")
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read {shown} as a memory size; use e.g. 12GiB, 12GB (=10^9 bytes), 16000MiB")
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if not 1 <= value <= MAX_SIZE:  # also inf from a number of hundreds of digits, and 0.5b (half a byte)
        raise ValueError(f"memory size must be from 1 byte to 1 EiB, got {shown}")
    return int(value)
