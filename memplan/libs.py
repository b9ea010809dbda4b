"""The library versions (and GPU architecture) an estimate models: those installed here, or those a stored
measurement ran with.

A few memory effects depend on the transformers release (which attention kernel a model's mask lets sdpa pick, for
one). The estimate models the installed release, which is the one a user trains with; `memplan check` re-estimates
each stored row under the versions recorded in it (memplan.measure.rows ENV_FIELDS), so old rows stay comparable.
"""
from __future__ import annotations

import contextlib
import functools
import re
from contextvars import ContextVar

_ASSUMED: ContextVar[dict[str, str]] = ContextVar("memplan_assumed_versions", default={})


def parse(v: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+(?:\.\d+)*)", v.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def dotted(release: tuple[int, ...] | None) -> str:
    """A release as people write it, (4, 48, 1) -> "4.48.1"; "unknown" for None."""
    return ".".join(map(str, release)) if release else "unknown"


def version(package: str) -> tuple[int, ...] | None:
    """(major, minor, ...) of `package` as assumed (assume()) or installed; None when neither is known."""
    v = _ASSUMED.get().get(package)
    if v:
        return parse(v)
    return _installed(package)


@functools.lru_cache(maxsize=None)
def _installed(package: str) -> tuple[int, ...] | None:
    """The installed release, read once per process (importlib.metadata reads the package's METADATA file: ~0.3 ms,
    and the estimator asks per estimate)."""
    import importlib.metadata  # lazily: 25 ms of the core's import time
    try:
        return parse(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def assumed(name: str) -> str | None:
    """A non-package assumption (e.g. compute_capability="9.0" of the GPU being planned for), None when unset."""
    return _ASSUMED.get().get(name)


def older_than(package: str, release: tuple[int, ...]) -> bool:
    """Whether `package` is known to predate `release` (unknown versions count as current)."""
    v = version(package)
    return v is not None and v < release


@contextlib.contextmanager
def assume(**versions: str | None):
    """Estimate as if these package versions were installed, or as for this GPU (compute_capability="8.6"); empty
    or None values are ignored."""
    token = _ASSUMED.set({**_ASSUMED.get(), **{k: v for k, v in versions.items() if v}})
    try:
        yield
    finally:
        _ASSUMED.reset(token)
