"""One daemon per state dir: the lock refuses a second holder by pid and is free again once released."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.node.statelock import LOCK_NAME, StateDirLock


def test_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = StateDirLock.acquire(state)
    assert (state / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    with pytest.raises(ConfigError, match=rf"another gpuwatch daemon \(pid {os.getpid()}\) already runs on state dir"):
        StateDirLock.acquire(state)
    first.release()
    first.release()
    StateDirLock.acquire(state).release()


def test_a_pid_file_with_junk_names_no_pid(tmp_path: Path) -> None:
    """The file is writable by whoever holds it; its text is never trusted as a pid."""
    first = StateDirLock.acquire(tmp_path)
    (tmp_path / LOCK_NAME).write_text("12; rm -rf /\n")
    with pytest.raises(ConfigError, match=r"\(another process\)"):
        StateDirLock.acquire(tmp_path)
    first.release()


def test_a_state_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"state_dir: cannot open the lock {blocker}/{LOCK_NAME}"):
        StateDirLock.acquire(blocker)
