"""Sweep files are checked against a schema (pydantic) before any run: every problem is named with its place."""
from __future__ import annotations

import pytest

from memplan.errors import BadInput
from memplan.measure.sweep import load_sweep


@pytest.mark.parametrize("text, needle", [
    ("models: gpt2x\n", "models: Input should be a valid list"),  # was iterated per character: 5 error rows, exit 0
    ("models: [gpt2]\nemulate: RTX 3060\n", "emulate: Input should be a valid list"),
    ("models: [gpt2]\ninclude: 5\n", "include: Input should be a valid list"),
    ("models: [gpt2]\nsteps: '3'\n", "steps: Input should be a valid integer"),
    ("models: [gpt2]\nsteps: 1\n", "steps: Input should be greater than or equal to 2"),
    ("models: [gpt2]\nmatrix: {batch_size: []}\n", "matrix.batch_size: List should have at least 1 item"),
    ("models: [gpt2]\nbase: {bogus: 1}\n", "unknown Setup field(s) ['base.bogus']"),
    ("models: [gpt2]\nfoo: 1\n", "foo: unknown key; allowed: models, model, base"),
    ("- gpt2\n", "must be a YAML mapping"),
    ("models: [gpt2\n", "is not valid YAML"),
])
def test_bad_sweep_files_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(BadInput) as e:
        load_sweep(path)
    assert needle in str(e.value)


def test_a_sweep_expanding_past_max_runs_is_refused_unless_the_file_raises_it(tmp_path):
    """issue 41: a sweep of 27 million combinations was expanded; above max_runs it is refused, and a file that means
    it says so."""
    values = list(range(1, 301))
    path = tmp_path / "s.yaml"
    path.write_text(f"models: [gpt2]\nmatrix: {{batch_size: {values}, grad_accum: {values}, lora_r: {values}}}\n")
    with pytest.raises(BadInput, match="expands to 27,000,000 runs, more than max_runs"):
        load_sweep(path)
    path.write_text(f"models: [gpt2]\nmax_runs: 200\nmatrix: {{batch_size: {values[:10]}, grad_accum: {values[:10]}}}\n")
    jobs, skipped, steps = load_sweep(path)
    assert len(jobs) == 100 and steps == 3


def test_an_include_may_name_its_own_model(tmp_path):
    # a re-measurement of rows of several models (benchmarks/sweeps/t524-recheck.yaml) lists each row with its model
    path = tmp_path / "s.yaml"
    path.write_text("base: {batch_size: 2}\ninclude:\n  - {model: gpt2, technique: lora}\n"
                    "  - {model: Qwen/Qwen2.5-0.5B, technique: full, seq_len: 128}\n")
    jobs, _, _ = load_sweep(path)
    assert [(j.model, j.setup.technique, j.setup.batch_size) for j in jobs] == [
        ("gpt2", "lora", 2), ("Qwen/Qwen2.5-0.5B", "full", 2)]
    path.write_text("models: [gpt2, t5-small]\ninclude:\n  - {technique: lora}\n  - {model: gpt2, technique: full}\n")
    assert [(j.model, j.setup.technique) for j in load_sweep(path)[0]] == [
        ("gpt2", "lora"), ("t5-small", "lora"), ("gpt2", "full")]
    path.write_text("models: [gpt2]\nbase: {model: gpt2}\n")
    with pytest.raises(BadInput, match=r"unknown Setup field\(s\) \['base.model'\]"):
        load_sweep(path)
