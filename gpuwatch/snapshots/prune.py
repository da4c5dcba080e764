"""The daemon's side of host snapshots: remove the slots of jobs that have had no live rank for a while.

A job's slots outlive its ranks on purpose (the relaunch restores from them), so a job with no
live rank is only pruned once its newest file is older than the grace period: longer than a
relaunch takes. A job that finishes removes its own slots; a reboot clears /dev/shm.

The daemon runs as root in a directory every local user can write to, so nothing here trusts a
name: each directory is opened with O_NOFOLLOW and used through its file descriptor, a per-user
directory is entered only when it belongs to the uid its name says, a job directory only when it
belongs to that uid too, and only regular files of that uid whose names are slot names are
unlinked (unlink removes a name, never what a link points to). Anything else is left alone.

`SquatWatch` finds names that claim a user but are not that user's directory (another user's
squat), counts them for the metrics, and removes those that are safe to remove.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from gpuwatch.snapshots.layout import is_job_dir_name, job_dir_name, names_in, parse_slot_name, user_of

log = logging.getLogger("gpuwatch.snapshots")

DEFAULT_GRACE_S = 900.0
"""How long a job with no live rank keeps its slots: a relaunch (torchrun's teardown, a restart) takes less."""

_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def prune(root: Path, live_jobs: set[tuple[int, str]], now: float, grace_s: float = DEFAULT_GRACE_S) -> list[Path]:
    """Remove the slots of every job under `root` that is not live and has not written for `grace_s` seconds.

    Args:
        root: where the per-user directories are (/dev/shm).
        live_jobs: (uid, job id) of every job with a live rank on this node.
        now: the wall-clock time (time.time()) to judge the grace period by.
        grace_s: how long after its last write a job with no live rank keeps its slots.

    Returns:
        The paths removed (slot files, then the emptied job directories).
    """
    live = {(uid, job_dir_name(job_id)) for uid, job_id in live_jobs}
    removed: list[Path] = []
    try:
        root_fd = os.open(root, _DIR & ~getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        log.debug("no snapshots to prune in %s: %s", root, exc)
        return removed
    try:
        for name in _names(root_fd):
            uid = user_of(name)
            if uid is None:
                continue
            with _owned_dir(root_fd, name, uid, root / name) as user_fd:
                if user_fd is None:
                    continue
                for job in _names(user_fd):
                    if is_job_dir_name(job) and (uid, job) not in live:
                        removed += _prune_job(user_fd, job, uid, root / name / job, now, grace_s)
    finally:
        os.close(root_fd)
    return removed


def _prune_job(user_fd: int, job: str, uid: int, path: Path, now: float, grace_s: float) -> list[Path]:
    removed: list[Path] = []
    with _owned_dir(user_fd, job, uid, path) as job_fd:
        if job_fd is None:
            return removed
        entries = []
        for name in _names(job_fd):
            with contextlib.suppress(FileNotFoundError):
                entries.append((name, os.stat(name, dir_fd=job_fd, follow_symlinks=False)))
        newest = max([os.fstat(job_fd).st_mtime] + [st.st_mtime for _, st in entries])
        if now - newest < grace_s:
            return removed
        for name, st in entries:
            if parse_slot_name(name) is None or not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                log.warning("snapshot prune: %s is not a slot file of uid %d: left alone", path / name, uid)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=job_fd)
                removed.append(path / name)
    try:
        os.rmdir(job, dir_fd=user_fd)
        removed.append(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            log.warning("snapshot prune: cannot remove %s: %s", path, exc)
    if removed:
        log.info("pruned the host snapshots of dead job %s (no live rank, idle %.0f s)", path, now - newest)
    return removed


@contextlib.contextmanager
def _owned_dir(parent_fd: int, name: str, uid: int, path: Path) -> Iterator[int | None]:
    """The directory `name` opened without following a link, when it belongs to `uid`; else None (logged)."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            log.warning("snapshot prune: %s is not a directory (a symlink or a file): left alone", path)
        yield None
        return
    try:
        owner = os.fstat(fd).st_uid
        if owner != uid:
            log.warning("snapshot prune: %s belongs to uid %d, not %d: left alone", path, owner, uid)
            yield None
        else:
            yield fd
    finally:
        os.close(fd)


def _names(dir_fd: int) -> list[str]:
    try:
        return sorted(names_in(dir_fd))
    except OSError:
        return []


class SquatWatch:
    """Names of the snapshot root that claim a user (`gpuwatch-<uid>`...) but are not that user's directory.

    Another user made them first, to keep that user's jobs out of their directory (they then
    snapshot to a directory of random name, layout.py). Each look removes those that are safe to
    remove as root in a sticky, world-writable directory: a link or a file (unlink removes the name,
    never what it points to). A directory is left alone and counted: removing it by name could race
    a legitimate mkdir of the same name.
    """

    def __init__(self) -> None:
        self.standing = 0  # squats left after the last look
        self.removed = 0  # squats removed since the daemon started
        self._reported: set[str] = set()

    def look(self, root: Path) -> list[Path]:
        """One pass over `root`; the squats removed (each logged), the others logged once each."""
        try:
            root_fd = os.open(root, _DIR & ~getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return []
        removed: list[Path] = []
        standing: set[str] = set()
        try:
            for name in _names(root_fd):
                uid = user_of(name)
                try:
                    st = os.stat(name, dir_fd=root_fd, follow_symlinks=False) if uid is not None else None
                except FileNotFoundError:
                    continue
                if st is None or (stat.S_ISDIR(st.st_mode) and st.st_uid == uid):
                    continue
                what = f"{root / name} (named for uid {uid}, a {_kind(st.st_mode)} of uid {st.st_uid})"
                if not stat.S_ISDIR(st.st_mode):
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                        os.unlink(name, dir_fd=root_fd)
                        log.warning("snapshot dir squat removed: %s", what)
                        removed.append(root / name)
                        continue
                standing.add(name)
                if name not in self._reported:
                    log.warning("snapshot dir squat: %s, left alone (that user snapshots elsewhere)", what)
        finally:
            os.close(root_fd)
        self._reported = standing
        self.standing = len(standing)
        self.removed += len(removed)
        return removed


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    return "directory" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "special file"
