"""Typed, actionable errors. Raised in the core; the CLI turns them into one clean message and an exit code."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class MemplanError(Exception):
    """Base class. `exit_code` is what the CLI exits with (2 = bad input)."""

    exit_code = 2


class BadInput(MemplanError):
    """The user's input is invalid; the message says what to change."""


class SetupError(BadInput):
    """One or more Setup fields are invalid; `problems` lists every one of them."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid setup ({len(self.problems)} problem(s)):\n{lines}")


class NotFound(BadInput):
    """A named thing (model, GPU, module) is not known; the message lists close matches."""


class TraceFailed(MemplanError):
    """The traced step (real transformers/peft/torch code on fake tensors) raised inside those libraries."""

    exit_code = 1


class OfflineError(MemplanError):
    """Something needed the network (the Hugging Face Hub) and it is not reachable."""


def schema_problems(error, allowed: Iterable[str] = ()) -> str:
    """A pydantic ValidationError as one line per problem, each with its place (`matrix.batch_size: ...`); an
    unknown key names the keys `allowed`."""
    def message(err: dict) -> str:
        if err["type"] == "extra_forbidden" and allowed:
            return f"unknown key; allowed: {', '.join(allowed)}"
        return err["msg"]
    return "\n".join(f"  - {'.'.join(map(str, err['loc'])) or 'file'}: {message(err)}" for err in error.errors())


def close_matches(name: str, choices: Iterable[str], n: int = 5) -> list[str]:
    """Closest names to `name` among `choices`, case-insensitive; substring hits first."""
    choices = list(choices)
    low = {c.lower(): c for c in choices}
    hits = [c for c in choices if name.lower() in c.lower()]
    # a catalog id the name extends ("Qwen/Qwen3-8B" for "Qwen/Qwen3-8B-instrct"), the longest first
    hits += sorted((c for c in choices if len(c) > 3 and c.lower() in name.lower()), key=len, reverse=True)
    fuzzy = [low[c] for c in difflib.get_close_matches(name.lower(), list(low), n=n, cutoff=0.5)]
    out: list[str] = []
    for c in hits + fuzzy:
        if c not in out:
            out.append(c)
    return out[:n]


def not_found(kind: str, name: str, choices: Iterable[str], hint: str) -> NotFound:
    """Build a NotFound naming the close matches and how to list all choices."""
    matches = close_matches(name, choices)
    did = f" Did you mean: {', '.join(matches)}?" if matches else ""
    return NotFound(f"unknown {kind} {name!r}.{did} {hint}")
