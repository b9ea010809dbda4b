"""One name, one quantity: every `*_bytes` key a command's --json prints is documented in docs/JSON.md, and the
commands that print a quantity name it alike."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli.main import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "JSON.md"
COMMANDS = {
    "estimate": ["estimate", "gpt2", "--json"],
    "fit": ["fit", "meta-llama/Llama-2-7b-hf", "--gpu", "t4", "--json"],
    "plan": ["plan", "gpt2", "--gpu", "t4", "--json"],
    "doctor": ["doctor", "meta-llama/Llama-2-7b-hf", "--technique", "full", "--gpu", "t4", "--json"],
}
NOT_QUANTITIES = {"components", "phases", "estimated_components", "traced_components", "setup", "pinned"}


def _json(args) -> dict:
    r = CliRunner().invoke(main, args)
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


def _byte_keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return {k for k in obj if k.endswith("_bytes") or "_bytes_" in k} | {
            key for k, v in obj.items() if k not in NOT_QUANTITIES for key in _byte_keys(v)}
    if isinstance(obj, list):
        return {key for v in obj for key in _byte_keys(v)}
    return set()


def _documented() -> set[str]:
    return set(re.findall(r"`(\w+)`", DOC.read_text()))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_bytes_key_is_documented(command):
    assert _byte_keys(_json(COMMANDS[command])) - _documented() == set()


@pytest.mark.slow
def test_trace_names_the_estimates_quantities_alike():
    trace = _json(["trace", "gpt2", "--batch-size", "1", "--seq-len", "64", "--json"])
    estimate = _json(["estimate", "gpt2", "--batch-size", "1", "--seq-len", "64", "--json"])
    shared = {"peak_allocated_bytes", "peak_reserved_bytes", "allocator_need_bytes"}
    assert shared <= set(trace) & set(estimate)
    assert trace["peak_tensor_bytes"] < trace["peak_allocated_bytes"] <= trace["allocator_need_bytes"]
    assert _byte_keys(trace) - _documented() == set()
