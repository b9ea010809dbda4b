"""Atomic file writes: every file memplan produces is written beside its target and renamed over it, so a crash
or Ctrl-C never leaves a half-written plan, CSV row or inventory (os.replace is atomic on POSIX and Windows)."""
from __future__ import annotations

import glob
import json
import os
import tempfile
from pathlib import Path

from memplan.errors import BadInput


def _new_file_mode() -> int:
    """What open() would give a new file: 0o666 less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _remove_orphaned_temps(path: Path) -> None:
    """Delete the temporary files a killed writer left beside `path` (named `<name>.<pid>.<random>.tmp`): those of a
    process that no longer runs. A live writer's file is left alone."""
    for tmp in path.parent.glob(f"{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 1:].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:  # alive, another user's
            pass


def _temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file beside `path`, named `<name>.<pid>.<random>.tmp` so that a later write can tell a dead
    writer's leftover (_remove_orphaned_temps)."""
    return tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.{os.getpid()}.", suffix=".tmp")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file beside `path`, flush it to disk, then rename it over `path` (never a half-written file,
    not even after a power loss). An existing file keeps its permissions (a 0600 plan stays 0600); a new one gets
    what open() would give it. Missing folders of `path` are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_temps(path)
    mode = path.stat().st_mode & 0o7777 if path.exists() else _new_file_mode()
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write text atomically (UTF-8)."""
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: Path, data, indent: int | None = None) -> None:
    """Write JSON atomically (compact unless indent is given)."""
    write_text_atomic(path, json.dumps(data, indent=indent, separators=(",", ":") if indent is None else None) + "\n")


def append_csv_row_atomic(path: Path, fieldnames: list[str], row: dict) -> None:
    """Append one row to a CSV (its header first when the file is new or empty), rewriting the file atomically."""
    import csv
    import io
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames, lineterminator="\n")
    if not old.strip():
        old = ""
        w.writeheader()
    elif not old.endswith("\n"):
        old += "\n"
    w.writerow(row)
    write_text_atomic(path, old + buf.getvalue())


def check_writable(path: Path, option: str = "--out") -> None:
    """Raise BadInput unless a file can be written at `path`, before any work whose result would go there: its
    folder is created as the write would create it, and a temporary file is made and removed in it (root ignores
    permission bits, so a probe is the only honest test; a read-only filesystem refuses it)."""
    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{option} {path} is a folder: name a file in it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _temp_beside(path)
        os.close(fd)
        os.unlink(tmp)
        if path.exists():
            with open(path, "ab"):
                pass
    except OSError as e:
        blocker = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else (e.strerror or str(e))
        raise BadInput(f"cannot write {option} {path}: {why}; choose a writable path") from None


# ------------------------------------------------------------------------------------------- the on-disk cache

def cache_dir() -> Path:
    """Where memplan keeps what it computed between runs (local configs' inventories, allocator replays):
    $MEMPLAN_CACHE, else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan."""
    if os.environ.get("MEMPLAN_CACHE"):
        return Path(os.environ["MEMPLAN_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memplan"


def source_digest(*parts: str) -> bytes:
    """The hash of memplan's own source under `parts` (sub-packages or modules, e.g. "inventory", "setup.py"): an
    edit to it, released or not, invalidates what was cached from it."""
    import hashlib
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for part in parts:
        path = root / part
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.read_bytes())
    return h.digest()


def content_key(parts: list[bytes], packages: tuple[str, ...]) -> str:
    """The key a result is cached under: its inputs' bytes and the releases of the packages that computed it."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version
    parts = list(parts)
    for package in (*packages, "memplan"):
        try:
            parts.append(version(package).encode())
        except PackageNotFoundError:
            parts.append(b"")
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:32]


def read_cached(kind: str, key: str):
    """The JSON cached under cache_dir()/kind/key.json, or None (not cached, unreadable, or another memplan's)."""
    try:
        return json.loads((cache_dir() / kind / (key + ".json")).read_text())
    except (OSError, ValueError):
        return None


def write_cached(kind: str, key: str, data) -> None:
    """Cache `data` (JSON) under cache_dir()/kind/key.json, atomically; a read-only home caches nothing."""
    try:
        path = cache_dir() / kind / (key + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, data)
    except OSError:
        pass
