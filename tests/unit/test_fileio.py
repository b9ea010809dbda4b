"""Atomic writes (memplan.fileio): every file memplan produces is renamed over its target once flushed to disk, keeps
an existing file's permissions, and a destination that cannot be written is refused before any work."""
from __future__ import annotations

import os
import stat

import pytest

from memplan.errors import BadInput
from memplan.fileio import check_writable, write_text_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_rewrite_keeps_the_files_permissions_and_leaves_no_temp_file(tmp_path):
    """issue 41: a 0600 plan file was rewritten 0644."""
    plan = tmp_path / "plan.yaml"
    write_text_atomic(plan, "a: 1\n")
    mask = os.umask(0)
    os.umask(mask)
    assert _mode(plan) == 0o666 & ~mask
    os.chmod(plan, 0o600)
    write_text_atomic(plan, "a: 2\n")
    assert plan.read_text() == "a: 2\n" and _mode(plan) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_the_data_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    """issue 41: no fsync before the rename (a power loss could leave an empty file under the final name)."""
    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1])
    write_text_atomic(tmp_path / "rows.csv", "model\n")
    assert order == ["fsync", "replace"]


def test_check_writable_refuses_a_folder_and_a_path_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(BadInput, match="is a folder"):
        check_writable(tmp_path)
    with pytest.raises(BadInput, match="afile is a file, not a folder"):
        check_writable(tmp_path / "afile" / "rows.csv")
    check_writable(tmp_path / "new" / "rows.csv")  # a missing folder is created, as the write would
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    """issue 41: .tmp files stayed beside their target after a kill (12 of 180 kills); the next write to the target
    removes those of processes that no longer run, and leaves a live writer's alone."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"rows.csv.{dead.stdout.strip()}.abc.tmp"
    live = tmp_path / f"rows.csv.{os.getppid()}.def.tmp"
    orphan.write_text("half")
    live.write_text("in progress")
    write_text_atomic(tmp_path / "rows.csv", "model\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rows.csv", live.name])
