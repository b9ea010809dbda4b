"""Sweep files: a matrix of setups to validate, run one subprocess each, one CSV row each, resumable.

A sweep file (YAML):

    models: [gpt2, meta-llama/Llama-3.2-1B]   # or model: gpt2
    base: {precision: bf16-mixed, seq_len: 512}   # Setup fields shared by every run
    matrix:                                   # the cartesian product of these Setup fields
      technique: [full, lora]
      batch_size: [1, 4]
    include:                                  # extra runs (each merged over base), outside the product
      - {technique: qlora, double_quant: true, grad_ckpt: true}
    exclude:                                  # drop runs matching every field given
      - {technique: full, batch_size: 4}
    emulate: [null, "RTX 3060"]               # optional: also run capped to these cards' memory
    steps: 3

Combinations the Setup refuses (e.g. double_quant without 4-bit) are skipped and counted, never run. Rows are
appended atomically as each run ends; a row whose key (memplan.measure.rows.row_key) is already in the output file is
not run again, so an interrupted sweep resumes where it stopped.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import BadInput, SetupError
from memplan.measure.rows import SETUP_FIELDS, append_row, done_keys, make_row, row_key
from memplan.setup import Setup
from memplan.measure.runner import validate

_KEYS = {"model", "models", "base", "matrix", "include", "exclude", "emulate", "steps"}


@dataclass(frozen=True, slots=True)
class Job:
    model: str
    setup: Setup
    emulate: str | None = None

    def key(self, device: str) -> str:
        return row_key(self.model, self.setup, device, None) if not self.emulate else \
            row_key(self.model, self.setup, device + "@" + self.emulate, None)


def _fields(d: dict, where: str) -> dict:
    if not isinstance(d, dict):
        raise BadInput(f"sweep: {where} must be a mapping of Setup fields")
    bad = [k for k in d if k not in SETUP_FIELDS]
    if bad:
        raise BadInput(f"sweep: {where} has unknown Setup field(s) {bad}; fields: {', '.join(SETUP_FIELDS)}")
    return dict(d)


def load_sweep(path: str | Path) -> tuple[list[Job], list[str], int]:
    """(jobs, skipped-combination messages, steps) from a sweep file."""
    import yaml
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise BadInput(f"cannot read sweep file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise BadInput(f"sweep file {path} is not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise BadInput(f"sweep file {path} must be a YAML mapping (models, base, matrix, include, exclude)")
    unknown = set(doc) - _KEYS
    if unknown:
        raise BadInput(f"sweep file {path}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(sorted(_KEYS))}")
    models = doc.get("models") or ([doc["model"]] if doc.get("model") else [])
    if not models:
        raise BadInput(f"sweep file {path} names no model: add `models: [gpt2, ...]`")
    base = _fields(doc.get("base") or {}, "base")
    matrix = _fields(doc.get("matrix") or {}, "matrix")
    for k, v in matrix.items():
        if not isinstance(v, list) or not v:
            raise BadInput(f"sweep: matrix.{k} must be a non-empty list")
    include = [_fields(d, "an include entry") for d in doc.get("include") or []]
    exclude = [_fields(d, "an exclude entry") for d in doc.get("exclude") or []]
    emulate = doc.get("emulate") or [None]
    steps = doc.get("steps", 3)
    combos = [dict(zip(matrix, values)) for values in itertools.product(*matrix.values())] if matrix else []
    if not matrix and not include:
        combos = [{}]
    runs = [{**base, **c} for c in combos] + [{**base, **d} for d in include]
    runs = [r for r in runs if not any(all(r.get(k) == v for k, v in ex.items()) for ex in exclude)]
    jobs, skipped, seen = [], [], set()
    for fields in runs:
        try:
            setup = Setup(**fields)
        except SetupError as e:
            skipped.append(f"{fields}: {'; '.join(e.problems)}")
            continue
        for model in models:
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


def now_iso() -> str:
    from datetime import datetime, timezone
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
