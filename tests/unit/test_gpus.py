"""GPU catalog: provenance, forgiving lookup, detection without a GPU, --memory."""
from __future__ import annotations

import subprocess
import sys

import pytest

from memplan import gpus
from memplan.errors import BadInput, NotFound
from memplan.units import GiB


def test_catalog_rows_have_sources_and_memory():
    rows = gpus.load_gpus()
    assert len(rows) >= 30
    assert all(g.source.startswith("https://") and g.memory_bytes > 0 for g in rows)
    assert len({g.name for g in rows}) == len(rows)


@pytest.mark.parametrize("name,expected", [
    ("3060", "GeForce RTX 3060 12GB"), ("rtx 3060 12gb", "GeForce RTX 3060 12GB"), ("RTX3060", "GeForce RTX 3060 12GB"),
    ("a100-80", "NVIDIA A100 80GB"), ("A100 80GB", "NVIDIA A100 80GB"), ("a100 80g", "NVIDIA A100 80GB"),
    ("a100 40gb", "NVIDIA A100 40GB"), ("h100", "NVIDIA H100 80GB"), ("4090", "GeForce RTX 4090"),
    ("t4", "Tesla T4"), ("MI300X", "AMD Instinct MI300X"), ("nvidia l4", "NVIDIA L4")])
def test_forgiving_names(name, expected):
    assert gpus.find_gpu(name).name == expected


def test_memory_and_bf16_facts():
    assert gpus.find_gpu("3060").memory_bytes == 12 * GiB
    assert gpus.find_gpu("t4").bf16 is False and gpus.find_gpu("a100").bf16 is True


def test_unknown_and_ambiguous():
    with pytest.raises(NotFound, match="memplan gpus"):
        gpus.find_gpu("voodoo5")
    with pytest.raises(BadInput, match="ambiguous"):
        gpus.find_gpu("30")


def test_resolve(monkeypatch):
    monkeypatch.setattr(gpus, "detect_gpus", lambda: [])
    assert gpus.resolve_gpu(memory="12GiB").memory_bytes == 12 * GiB
    assert gpus.resolve_gpu(memory="24GB").memory_bytes == 24 * 10**9
    with pytest.raises(BadInput, match="no GPU detected"):
        gpus.resolve_gpu()
    with pytest.raises(BadInput, match="either"):
        gpus.resolve_gpu("3060", "12GiB")
    with pytest.raises(BadInput, match="memory size"):
        gpus.resolve_gpu(memory="lots")
    fake = gpus.Gpu(name="NVIDIA H100 80GB HBM3", memory_bytes=85_520_809_984, detected=True)
    monkeypatch.setattr(gpus, "detect_gpus", lambda: [fake])
    assert gpus.resolve_gpu() is fake


def test_detection_without_gpu_is_empty():
    assert gpus.detect_gpus() == []


def test_import_is_light():
    code = "import sys, memplan.gpus; print('torch' in sys.modules, 'pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
