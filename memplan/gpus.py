"""GPU catalog (memplan/data/gpus.csv, a source per row), forgiving name lookup and NVML detection (lazy pynvml).

Memory is the vendor's nominal figure, whose "GB" for GPU memory is binary (GiB): a 24 GB card is 24 x 2^30
bytes nominal. NVML reports slightly less on some cards (ECC, reserved regions); detected GPUs carry NVML's total.
"""
from __future__ import annotations

import csv
import difflib
import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path

from memplan.units import GiB, MiB, fmt_gib, parse_size
from memplan.errors import BadInput, MemplanError, NotFound
from memplan import libs

CSV = Path(__file__).parent / "data" / "gpus.csv"


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory_bytes: int
    compute_capability: str = ""
    architecture: str = ""
    bf16: bool = True
    vendor: str = "nvidia"
    source: str = ""
    aliases: tuple[str, ...] = ()
    detected: bool = False
    free_bytes: int | None = None


def _norm(text: str) -> str:
    """'RTX-3060 12 GB' -> 'rtx306012g': lower case, no separators, 'gb'/'gib' -> 'g', vendor words dropped."""
    t = text.lower()
    t = re.sub(r"\b(nvidia|geforce|tesla|amd|instinct|tensor core gpu)\b", "", t)
    t = re.sub(r"gi?b\b", "g", t)
    return re.sub(r"[\s_\-]+", "", t)


@functools.lru_cache(maxsize=1)
def load_gpus() -> tuple[Gpu, ...]:
    """Every catalog row as a Gpu."""
    with CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return tuple(Gpu(name=r["name"], memory_bytes=int(float(r["memory_gib"]) * GiB),
                     compute_capability=r["compute_capability"], architecture=r["architecture"],
                     bf16=r["bf16"] == "yes", vendor=r["vendor"], source=r["source"],
                     aliases=tuple(a.strip() for a in r["aliases"].split(";") if a.strip())) for r in rows)


def find_gpu(name: str) -> Gpu:
    """Catalog GPU for `name`: exact name or alias after normalisation ("3060", "rtx 3060 12gb", "A100-80",
    "a100 80g"), else the unique catalog entry whose normalised name contains it. "a100" alone is the 80 GB card
    (listed as its alias: the common cloud default); any other ambiguity lists the candidates."""
    if not isinstance(name, str):
        raise BadInput(f"a GPU name is text such as \"RTX 3060\", got {name!r}; run `memplan gpus` to list the names")
    key = _norm(name)
    if not key:
        raise BadInput("empty GPU name; run `memplan gpus` to list the names")
    gpus = load_gpus()
    for g in gpus:
        if key == _norm(g.name) or key in {_norm(a) for a in g.aliases}:
            return g
    hits = [g for g in gpus if key in _norm(g.name) or any(key in _norm(a) for a in g.aliases)]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise BadInput(f"GPU name {name!r} is ambiguous: {', '.join(g.name for g in hits)}; name one of them")
    close = similar_gpus(key, gpus)
    did = f" Did you mean: {', '.join(close)}?" if close else ""
    raise NotFound(f"unknown GPU {name!r}.{did} Run `memplan gpus` to list them, or pass --memory 12GiB.")


def similar_gpus(key: str, gpus) -> list[str]:
    """Catalog names whose normalised name or alias is closest to the normalised `key` ("rtx3600" -> RTX 3060):
    compared without vendor words and separators, so a transposed digit is one edit, not a different card."""
    by_key: dict[str, str] = {}
    for g in gpus:
        for k in (_norm(g.name), *map(_norm, g.aliases)):
            by_key.setdefault(k, g.name)
    out: list[str] = []
    close = difflib.get_close_matches(key, list(by_key), n=8, cutoff=0.75)
    for k in sorted(close, key=lambda c: sorted(c) != sorted(key)):  # a transposition first: 3600 -> 3060
        if by_key[k] not in out:
            out.append(by_key[k])
    return out[:5]


def detect_gpus() -> list[Gpu]:
    """GPUs visible through NVML (name, total and free memory), matched to the catalog for compute capability and
    bf16; [] when NVML or a driver is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver / no library: no GPU to detect, by design not an error
        return []
    try:
        return [_detected(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _detected(pynvml, index: int) -> Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else name
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    try:
        base = find_gpu(name)
    except BadInput:
        base = Gpu(name=name, memory_bytes=int(mem.total), compute_capability=f"{major}.{minor}",
                   bf16=major >= 8, source="detected through NVML")
    return replace(base, name=name, memory_bytes=int(mem.total), free_bytes=int(mem.free),
                   compute_capability=f"{major}.{minor}", bf16=major >= 8, detected=True)


def refuse_empty_card(name: str | None, memory: int | str | None) -> None:
    """BadInput for an empty --gpu or --memory: given but blank, which would otherwise read as not given."""
    for option, value in (("--gpu", name), ("--memory", memory)):
        if isinstance(value, str) and not value.strip():
            raise BadInput(f"{option} is empty: name a GPU (`memplan gpus` lists them) or give a size such as 12GiB")


def resolve_gpu(name: str | None = None, memory: int | str | None = None) -> Gpu:
    """--gpu NAME, --memory SIZE (a custom card, bf16 assumed), or the first detected GPU."""
    refuse_empty_card(name, memory)
    if name and memory:
        raise BadInput("pass either --gpu or --memory, not both")
    if name:
        return find_gpu(name)
    if memory:
        try:
            n = memory if isinstance(memory, int) else parse_size(memory)
        except ValueError as e:
            raise BadInput(str(e)) from None
        return Gpu(name=f"custom {fmt_gib(n)}", memory_bytes=n, source="--memory")
    found = detect_gpus()
    if not found:
        raise BadInput('no GPU detected (NVML found none); name one with --gpu (e.g. --gpu "RTX 3060") or give '
                       "its memory with --memory 12GiB; `memplan gpus` lists the names")
    return found[0]


def assume_gpu(gpu: "Gpu | str | None"):
    """Estimate for this GPU's architecture (a Gpu or a name as NVML reports it; unknown names assume nothing):
    the cuBLAS workspace size depends on it (cublas_workspace_bytes)."""
    if isinstance(gpu, str):
        try:
            gpu = find_gpu(gpu)
        except MemplanError:
            gpu = None
    memory = getattr(gpu, "memory_bytes", None)
    return libs.assume(compute_capability=getattr(gpu, "compute_capability", None) or None,
                       gpu_memory_bytes=str(memory) if memory else None)


#: cuBLAS workspace PyTorch allocates through its caching allocator, one per (cuBLAS handle, stream), on the first
#: matmul (aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize, torch >= 2.7): 32 MiB on compute
#: capability 9.x, 10.x and 12.x (Hopper, Blackwell), else the ":4096:2:16:8" config (2 x 4 MiB + 8 x 16 KiB); cuBLASLt
#: uses the same buffer (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default). Handles are per thread: a training step
#: runs its backward matmuls on autograd's device thread, so training holds two workspaces. Checked on the H100 rows
#: (data/measured/gpu-h100.csv): with 2 x 32 MiB the median |error| of peak allocated fell from 0.91% to 0.30%.
CUBLAS_WORKSPACE_LARGE = 32 * MiB


CUBLAS_WORKSPACE_SMALL = 2 * 4096 * 1024 + 8 * 16 * 1024


#: compute-capability majors with the 32 MiB default (an unknown GPU gets it too: never under-predicts)
LARGE_WORKSPACE_MAJORS = (9, 10, 12)


def cublas_workspace_bytes(training: bool) -> int:
    """cuBLAS workspaces alive during the step on the GPU being estimated for (memplan.libs.assume(
    compute_capability=...); unknown: the 32 MiB default)."""
    cc = libs.assumed("compute_capability")
    try:
        major = int(str(cc).split(".")[0]) if cc else None
    except ValueError:
        major = None
    per = CUBLAS_WORKSPACE_LARGE if major is None or major in LARGE_WORKSPACE_MAJORS else CUBLAS_WORKSPACE_SMALL
    return per * (2 if training else 1)
