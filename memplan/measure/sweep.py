"""Sweep files: a matrix of setups to validate, run one subprocess each, one CSV row each, resumable.

A sweep file (YAML):

    models: [gpt2, meta-llama/Llama-3.2-1B]   # or model: gpt2
    base: {precision: bf16-mixed, seq_len: 512}   # Setup fields shared by every run
    matrix:                                   # the cartesian product of these Setup fields
      technique: [full, lora]
      batch_size: [1, 4]
    include:                                  # extra runs (each merged over base), outside the product
      - {technique: qlora, double_quant: true, grad_ckpt: true}
      - {model: Qwen/Qwen2.5-0.5B, technique: lora}   # a run of that model only (models may then be empty)
    exclude:                                  # drop runs matching every field given
      - {technique: full, batch_size: 4}
    emulate: [null, "RTX 3060"]               # optional: also run capped to these cards' memory
    steps: 3
    max_runs: 10000                           # refuse a file that expands to more runs (raise it on purpose)

Combinations the Setup refuses (e.g. double_quant without 4-bit) are skipped and counted, never run. Rows are
appended atomically as each run ends; a row whose key (memplan.measure.rows.row_key) is already in the output file is
not run again, so an interrupted sweep resumes where it stopped.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memplan.errors import BadInput, SetupError, schema_problems
from memplan.measure.rows import SETUP_FIELDS, append_row, done_keys, make_row, row_key
from memplan.setup import Setup
from memplan.measure.runner import validate



@dataclass(frozen=True, slots=True)
class Job:
    model: str
    setup: Setup
    emulate: str | None = None

    def key(self, device: str) -> str:
        return row_key(self.model, self.setup, device, None) if not self.emulate else \
            row_key(self.model, self.setup, device + "@" + self.emulate, None)


#: runs a sweep may expand to unless its file raises `max_runs` (a typo in a matrix can ask for millions)
MAX_RUNS = 10_000


class SweepFile(BaseModel):
    """The schema of a sweep file (module docstring); pydantic reports every problem with its place."""

    model_config = ConfigDict(extra="forbid", strict=True)
    models: list[str] = Field(default_factory=list)
    model: str | None = None
    base: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(default_factory=dict)
    include: list[dict[str, Any]] = Field(default_factory=list)
    exclude: list[dict[str, Any]] = Field(default_factory=list)
    emulate: list[str | None] = Field(default_factory=lambda: [None])
    steps: int = Field(default=3, ge=2)
    max_runs: int = Field(default=MAX_RUNS, ge=1)


def _unknown_fields(doc: SweepFile) -> list[str]:
    where = [("base", doc.base), ("matrix", doc.matrix), *((f"include[{i}]", d) for i, d in enumerate(doc.include)),
             *((f"exclude[{i}]", d) for i, d in enumerate(doc.exclude))]
    return [f"{place}.{k}" for place, d in where for k in d
            if k not in SETUP_FIELDS and not (k == "model" and place.startswith("include"))]


def load_sweep(path: str | Path) -> tuple[list[Job], list[str], int]:
    """(jobs, skipped-combination messages, steps) from a sweep file."""
    import yaml
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise BadInput(f"cannot read sweep file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"sweep file {path} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise BadInput(f"sweep file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"sweep file {path} must be a YAML mapping (models, base, matrix, include, exclude)")
    try:
        doc = SweepFile.model_validate(raw)
    except ValidationError as e:
        raise BadInput(f"sweep file {path}:\n{schema_problems(e, SweepFile.model_fields)}") from None
    unknown = _unknown_fields(doc)
    if unknown:
        raise BadInput(f"sweep file {path}: unknown Setup field(s) {unknown}; fields: {', '.join(SETUP_FIELDS)}")
    models = doc.models or ([doc.model] if doc.model else [])
    if not models and not any("model" in d for d in doc.include):
        raise BadInput(f"sweep file {path} names no model: add `models: [gpt2, ...]`")
    base, matrix, include, exclude, emulate, steps = doc.base, doc.matrix, doc.include, doc.exclude, doc.emulate, doc.steps
    own = [d for d in include if "model" in d]
    shared = [d for d in include if "model" not in d]
    runs = (math.prod(len(v) for v in matrix.values()) if matrix else (0 if include else 1)) + len(shared)
    total = runs * len(models) + len(own)
    if total * len(emulate) > doc.max_runs:
        raise BadInput(f"sweep file {path} expands to {total * len(emulate):,} runs, more than "
                       f"max_runs ({doc.max_runs:,}): narrow the matrix, or raise max_runs in the file")
    combos = [dict(zip(matrix, values)) for values in itertools.product(*matrix.values())] if matrix else []
    if not matrix and not include:
        combos = [{}]
    runs = [({**base, **c}, models) for c in combos] + [({**base, **d}, models) for d in shared] + \
        [({**base, **{k: v for k, v in d.items() if k != "model"}}, [d["model"]]) for d in own]
    runs = [(r, m) for r, m in runs if not any(all(r.get(k) == v for k, v in ex.items()) for ex in exclude)]
    jobs, skipped, seen = [], [], set()
    for fields, run_models in runs:
        try:
            setup = Setup(**fields)
        except SetupError as e:
            skipped.append(f"{fields}: {'; '.join(e.problems)}")
            continue
        for model in run_models:
            for card in emulate:
                job = Job(str(model), setup, card)
                if job not in seen:
                    seen.add(job)
                    jobs.append(job)
    return jobs, skipped, steps


def run_sweep(jobs: list[Job], out: str | Path, device: str = "cuda", steps: int = 3,
              runner: Callable | None = None, on_done: Callable | None = None, timeout: float | None = None,
              notes: str = "") -> dict[str, int]:
    """Run every job whose key has no result in `out` yet (an errored row is run again and its new row replaces
    it), appending one row per run as it ends.
    runner(model, setup, device, steps, emulate, timeout) -> Measurement (default memplan.measure.runner.validate).
    on_done(job, measurement) after each row is written (progress); `notes` goes into every row's notes column.
    Returns counts: run, skipped_done, by status."""
    if runner is None:
        def runner(model, setup, device, steps, emulate, timeout):
            return validate(model, setup, device=device, steps=steps, emulate=emulate, timeout=timeout)
    done = done_keys(out)
    counts = {"run": 0, "already_done": 0, "ok": 0, "oom": 0, "error": 0}
    for job in jobs:
        key = job.key(device)
        if key in done:
            counts["already_done"] += 1
            continue
        m = runner(job.model, job.setup, device, steps, job.emulate, timeout)
        row_notes = "; ".join(n for n in (f"emulating {job.emulate}" if job.emulate else "", notes) if n)
        append_row(out, make_row(job.model, job.setup, key=key, source="memplan validate", notes=row_notes,
                                 measured_at=now_iso(), **m.row_values()), supersede_errors=True)
        done.add(key)
        counts["run"] += 1
        counts[m.status] = counts.get(m.status, 0) + 1
        if on_done is not None:
            on_done(job, m)
    return counts


def already_done(jobs: list[Job], out: str | Path, device: str = "cuda") -> int:
    """How many of `jobs` have a result in `out` already (run_sweep skips them): where a resumed sweep's progress
    starts."""
    done = done_keys(out)
    return sum(job.key(device) in done for job in jobs)


def now_iso() -> str:
    from datetime import datetime, timezone
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
