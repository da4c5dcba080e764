"""One daemon per state directory: an exclusive flock on `<state_dir>/gpuwatch.lock`, held for the daemon's life.

Two daemons on one state dir would share the quarantine database, the token and (usually) the
runtime dir's status.json, and each would judge and signal trainers on its own. The kernel drops
the lock when the holder dies, so a crashed daemon never leaves a stale lock behind; the file only
carries the holder's pid so the refusal can name it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

from gpuwatch.errors import ConfigError

LOCK_NAME = "gpuwatch.lock"


class StateDirLock:
    """The held lock; `release()` (or process exit) gives it back."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._file = os.fdopen(fd, "r+b")  # a file object, so a Daemon dropped half-built still unlocks

    @classmethod
    def acquire(cls, state_dir: str | Path) -> StateDirLock:
        """Take the lock, creating the state dir (0700) when missing, and write our pid into it.

        Raises:
            ConfigError: another process holds it (its pid is named), or the file cannot be opened.
        """
        path = Path(state_dir) / LOCK_NAME
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise ConfigError(f"state_dir: cannot open the lock {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise ConfigError(
                f"another gpuwatch daemon ({who}) already runs on state dir {path.parent} (it holds {path}); "
                "stop it, or give this one another --state-dir and --runtime-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock and close; twice is once. The file stays (removing it would race a new daemon)."""
        self._file.close()


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote, or None when the file does not hold one (a local user can write it)."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() and len(text) <= 10 else None


class NewDaemonDir:
    """What of a daemon dir's path (state or runtime) is missing before it starts: a start that fails removes
    what it made.

    A first `gpuwatch run` that fails (a busy port, no GPU) must leave no state dir, lock file or token behind
    that the next try, or `rm -rf`, would have to deal with. A directory that was there is never touched.
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir).absolute()
        self.made = [d for d in (self.path, *self.path.parents) if not d.exists()]  # deepest first

    def remove(self) -> None:
        """Remove the directory and the parents this start made, when it made the directory."""
        if not self.made:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.made[1:]:
            with contextlib.suppress(OSError):  # something else lives there now
                parent.rmdir()
