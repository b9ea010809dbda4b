"""Measured rows: one CSV schema shared by `memplan validate`, `memplan check` and memplan.measure.callbacks.

A row is one setup run on one device: the model id, every Setup field (one column each, so a row can be re-estimated
by any later estimator), what was measured, and the environment it was measured in (GPU, driver, CUDA, package
versions). Files are appended one row at a time, atomically (memplan.fileio): a crash or Ctrl-C leaves the file as
it was before that row, never half a row. `row_key` identifies a setup so a sweep resumes where it stopped.

Measured quantities (bytes; empty when not measured):
  measured_allocated_bytes   torch.cuda.max_memory_allocated over the steady-state steps (tracer: live storages)
  measured_requested_bytes   torch.cuda's requested_bytes.all.peak over the same steps: the bytes the tensors asked
                             for; allocated counts whole blocks, a block handed out unsplit included (memplan.runtime.allocator)
  measured_reserved_bytes    torch.cuda.max_memory_reserved (the caching allocator's segments)
  measured_device_bytes      NVML used memory at its highest sample (CUDA context, reserved and paged memory)
  cuda_context_bytes         NVML used after CUDA init, before the first allocation
status: ok | oom (the run hit an out-of-memory error: a result, not a failure) | error (anything else; `error` says)
Published rows (data/published/) use the same columns plus `tolerance` (a fraction applied to that row instead of
the command's), `gate` (no = reported, never fails the check) and `trust`; `source` cites where the number comes from.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
from pathlib import Path

from memplan.errors import BadInput
from memplan.fileio import write_text_atomic
from memplan.setup import DISTRIBUTED_FIELDS, INTEGER_FIELDS, Setup
from memplan import __version__

SETUP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Setup))
QUANTITIES = ("allocated", "reserved", "device")
ENV_FIELDS = ("gpu", "gpu_memory_bytes", "driver", "cuda", "torch", "transformers", "peft", "bitsandbytes",
              "memplan", "python", "libraries")
#: the other packages whose code a measured step can run, recorded as "name version; ..." where installed
STEP_LIBRARIES = ("accelerate", "trl", "liger-kernel", "torchao", "schedulefree", "galore-torch", "apollo-torch",
                  "gptqmodel", "triton")
COLUMNS: tuple[str, ...] = (
    "key", "model", *SETUP_FIELDS, "status", "error", "device", "steps",
    "measured_allocated_bytes", "measured_requested_bytes", "measured_reserved_bytes", "measured_device_bytes",
    "cuda_context_bytes", "peak_phase", "phase_allocated", "alloc_retries", "num_ooms", "memory_fraction",
    "memory_limit_bytes",
    *ENV_FIELDS, "measured_at", "source", "tolerance", "gate", "trust", "notes",
)
_INT_COLUMNS = ("measured_allocated_bytes", "measured_requested_bytes", "measured_reserved_bytes",
                "measured_device_bytes", "cuda_context_bytes", "alloc_retries", "num_ooms", "memory_limit_bytes",
                "gpu_memory_bytes", "steps")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


#: Setup fields added after measured rows were keyed (issue 39): left out of a row's key at their defaults
LATER_FIELDS = ("use_dora", "use_liger_kernel", "train_new_tokens", "task", "group_size")


def setup_columns(setup: Setup) -> dict[str, str]:
    """The Setup as one string cell per field (lists comma-joined, None empty)."""
    return {k: _cell(v) for k, v in setup.to_dict().items()}


def _parse_setup_value(name: str, text: str, default):
    if text == "":
        return None if default is None else default
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{name}={text!r} is not true/false")
        return text.lower() in ("true", "1", "yes")
    if name == "lora_targets":
        return text if text == "all-linear" else tuple(text.split(","))
    if name == "trainable":
        return int(text) if text.isdigit() else tuple(text.split(","))
    if isinstance(default, float) or name == "lora_dropout":
        return float(text)
    if isinstance(default, int) or name in INTEGER_FIELDS:
        return int(text)
    return text


def setup_from_row(row: dict) -> Setup:
    """The Setup a row describes (SetupError when a value is invalid; unknown or missing columns keep defaults)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Setup)}
    fields = {}
    for name in SETUP_FIELDS:
        if name in row and row[name] is not None:
            try:
                value = _parse_setup_value(name, str(row[name]).strip(), defaults[name])
            except ValueError as e:
                raise BadInput(f"cannot read column {name}: {e}") from None
            if value is not None:
                fields[name] = value
    return Setup(**fields)


def row_key(model: str, setup: Setup, device: str = "cuda", memory_fraction: float | None = None) -> str:
    """A short stable id of (model, setup, device, memory cap): what a resumed sweep skips."""
    fields = setup.to_dict()
    for name in (*DISTRIBUTED_FIELDS, "padded", *LATER_FIELDS):  # rows keep the keys they had before these existed
        if fields[name] == Setup.__dataclass_fields__[name].default:
            del fields[name]
    payload = json.dumps([model, fields, device, memory_fraction], sort_keys=True, default=str)
    return hashlib.sha1(payload.encode()).hexdigest()[:12]


def make_row(model: str, setup: Setup, **values) -> dict[str, str]:
    """A full row (every column, as strings) from the model, the setup and any other column values."""
    unknown = set(values) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown measured-row columns: {sorted(unknown)}")
    row = dict.fromkeys(COLUMNS, "")
    row.update(setup_columns(setup))
    row["model"] = model
    row.update({k: _cell(v) for k, v in values.items()})
    if not row["key"]:
        frac = values.get("memory_fraction")
        row["key"] = row_key(model, setup, values.get("device") or "cuda", float(frac) if frac else None)
    return row


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """Every row of a measured CSV (missing columns read as empty strings)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"{path} is not UTF-8 text (byte {e.start}): a measured-rows CSV is written in UTF-8") from None
    try:
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames is None:
            return []
        if "model" not in reader.fieldnames:
            raise BadInput(f"{path} is not a measured-rows CSV (no 'model' column); expected the columns of "
                           "memplan.measure.rows.COLUMNS")
        return [{c: (r.get(c) or "") for c in (*COLUMNS, *reader.fieldnames)} for r in reader]
    except csv.Error as e:
        raise BadInput(f"{path} is not a readable CSV: {e}") from None


def measured_files(paths) -> list[Path]:
    """The CSV files named, or found (recursively) in the folders named, sorted."""
    out: list[Path] = []
    if isinstance(paths, (str, Path)):  # one path, not its characters
        paths = [paths]
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.rglob("*.csv")))
        elif p.is_file():
            out.append(p)
        else:
            raise BadInput(f"{p} does not exist: name a measured CSV or a folder of them (e.g. data/measured/)")
    return out


def append_row(path: str | Path, row: dict, supersede_errors: bool = False) -> None:
    """Append one row, atomically: the file is rewritten beside itself with the new row and renamed over the old
    one, so an interrupted write leaves the previous file intact. Writes the header on a new file; rows keep the
    file's column order. A row with values in columns the file lacks (a file written before those columns
    existed) widens the file: the missing columns are added in COLUMNS order, empty for its earlier rows, which is
    how read_rows reads them anyway.

    supersede_errors: drop the file's "error" rows with this row's key (a retried run replaces its failed attempt,
    so a key has one row)."""
    path = Path(path)
    existing = path.read_text() if path.exists() else ""
    if existing.strip() and supersede_errors and row.get("key"):
        existing = _without_errors_of(existing, row["key"])
    if existing.strip():
        header = next(csv.reader(io.StringIO(existing)))
        extra = {k for k, v in row.items() if k not in header and v not in ("", None)}
        if extra:
            header = _widened(header, extra)
            existing = _rewritten(existing, header)
    else:
        header, existing = list(COLUMNS), ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header, extrasaction="ignore", lineterminator="\n")
    if not existing:
        w.writeheader()
    elif not existing.endswith("\n"):
        existing += "\n"
    w.writerow({k: _cell(row.get(k)) if not isinstance(row.get(k), str) else row[k] for k in header})
    write_text_atomic(path, existing + buf.getvalue())


def _widened(header: list[str], extra: set[str]) -> list[str]:
    """The file's header with the `extra` columns inserted where COLUMNS has them (after the nearest column the
    file already holds); columns unknown to COLUMNS go last."""
    out = list(header)
    for name in sorted(extra, key=lambda c: COLUMNS.index(c) if c in COLUMNS else len(COLUMNS)):
        before = COLUMNS[:COLUMNS.index(name)] if name in COLUMNS else ()
        anchor = max((out.index(c) for c in before if c in out), default=len(out) - 1)
        out.insert(anchor + 1, name)
    return out


def _rewritten(text: str, header: list[str]) -> str:
    """`text` (a CSV with a header) with `header`'s columns, empty where its rows had none."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
    w.writeheader()
    w.writerows(csv.DictReader(io.StringIO(text)))
    return buf.getvalue()


def _without_errors_of(text: str, key: str) -> str:
    """`text` (a CSV with a header) less its rows with `key` whose status is "error"."""
    reader = csv.DictReader(io.StringIO(text))
    kept = [r for r in reader if not (r.get("key") == key and r.get("status") == "error")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=reader.fieldnames, lineterminator="\n")
    w.writeheader()
    w.writerows(kept)
    return buf.getvalue()


#: the statuses that are results: an OOM is what the setup does; an error (a crash, a killed or timed-out run, a
#: model that cannot be built) is not, and a resumed sweep runs it again
RESULT_STATUSES = ("ok", "oom")


def done_keys(path: str | Path) -> set[str]:
    """Keys of the rows in `path` that hold a result (ok or oom; empty when the file does not exist): a resumed
    sweep skips them and retries the rest."""
    path = Path(path)
    if not path.exists():
        return set()
    return {r["key"] for r in read_rows(path) if r.get("key") and r.get("status") in RESULT_STATUSES}


def int_or_none(text: str) -> int | None:
    """A stored byte count; None when empty. BadInput for anything else that is not a finite number."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        return int(float(text))
    except (ValueError, OverflowError):
        raise BadInput(f"cannot read {text[:40]!r} as a byte count") from None


def environment(device: str = "cuda") -> dict[str, str]:
    """Versions and the GPU a measurement ran with: GPU name and memory, NVIDIA driver, CUDA (torch's build),
    torch, transformers, peft, bitsandbytes, memplan, Python, and the STEP_LIBRARIES installed (`libraries`).
    Missing packages read as empty."""
    import platform
    from importlib import metadata

    env = dict.fromkeys(ENV_FIELDS, "")
    for pkg in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    env["memplan"] = __version__
    env["python"] = platform.python_version()
    found = []
    for pkg in STEP_LIBRARIES:
        try:
            found.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    env["libraries"] = "; ".join(found)
    if device == "cpu":
        env["gpu"] = "cpu"
        return env
    import torch
    env["cuda"] = torch.version.cuda or ""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"], env["gpu_memory_bytes"] = props.name, str(props.total_memory)
    try:
        import pynvml
        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(env["driver"], bytes):
            env["driver"] = env["driver"].decode()
    except Exception:  # no NVML: the driver version stays empty
        pass
    return env
