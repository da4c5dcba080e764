"""Where host snapshots live, and opening their directories without trusting the world-writable /dev/shm.

    /dev/shm/gpuwatch-<uid>/                 0700, owned by <uid>: one per user, created by the first job
        job-<job id>/                        0700: one per job (its TORCHELASTIC_RUN_ID or GPUWATCH_JOB_ID)
            rank-00000.slot0, rank-00000.slot1   0600: each rank's two slots

Another local user can create `/dev/shm/gpuwatch-<uid>` before the job does (a directory of
theirs, a symlink to somewhere else): so the directory is opened with O_NOFOLLOW, checked to be a
directory owned by this process's uid with no group or other access, and used through its file
descriptor from then on (dir_fd), so a rename or a symlink swapped in later changes nothing. When
the check fails the job gets no snapshot (one log line) and resumes from the disk.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat

DEFAULT_ROOT = "/dev/shm"
ROOT_ENV = "GPUWATCH_SNAPSHOT_ROOT"
"""Where the per-user directories go (default /dev/shm): a tmpfs that outlives the process, cleared at reboot."""

_USER_DIR = re.compile(r"^gpuwatch-(0|[1-9][0-9]{0,9})$")
_JOB_DIR = re.compile(r"^job-([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")
_SLOT_FILE = re.compile(r"^rank-([0-9]{5,7})\.slot([01])(?:\.tmp)?$")
_SAFE_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
SLOTS = (0, 1)

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class SnapshotDirError(Exception):
    """The snapshot directory cannot be used safely; the message is the one-line reason."""


def snapshot_root() -> str:
    """The root the per-user directories are in: $GPUWATCH_SNAPSHOT_ROOT, else /dev/shm."""
    return os.environ.get(ROOT_ENV) or DEFAULT_ROOT


def user_dir_name(uid: int) -> str:
    return f"gpuwatch-{uid}"


def user_of(name: str) -> int | None:
    """The uid a per-user directory name is for (the inverse of user_dir_name), else None."""
    match = _USER_DIR.match(name)
    return int(match.group(1)) if match else None


def job_dir_name(job_id: str) -> str:
    """`job-<id>` for an id of letters, digits, '.', '_' and '-'; any other id is hashed (it names a directory)."""
    if _SAFE_JOB_ID.match(job_id) and job_id not in (".", ".."):
        return f"job-{job_id}"
    return f"job-h{hashlib.sha256(job_id.encode()).hexdigest()[:32]}"


def is_job_dir_name(name: str) -> bool:
    return _JOB_DIR.match(name) is not None


def slot_name(rank: int, slot: int) -> str:
    return f"rank-{rank:05d}.slot{slot}"


def parse_slot_name(name: str) -> tuple[int, int] | None:
    """(rank, slot) of a slot file name (or of its temp name while it is being created), else None."""
    match = _SLOT_FILE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def open_job_dir(root: str, job_id: str, *, create: bool = True) -> int:
    """A file descriptor of this user's directory for `job_id` under `root`, created 0700 when missing.

    Raises:
        SnapshotDirError: root is missing, or the per-user or job directory is not a directory of
            this uid that only it can enter (someone else made it, or it is a symlink), or it cannot be
            created. The message names the path and what is wrong with it.
    """
    uid = os.getuid()
    try:
        root_fd = os.open(root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))  # the root itself may be a link (/dev/shm)
    except OSError as exc:
        raise SnapshotDirError(f"{root}: {exc.strerror or exc}") from None
    try:
        user_fd = _private_dir(root_fd, user_dir_name(uid), f"{root}/{user_dir_name(uid)}", uid, create)
    finally:
        os.close(root_fd)
    try:
        name = job_dir_name(job_id)
        return _private_dir(user_fd, name, f"{root}/{user_dir_name(uid)}/{name}", uid, create)
    finally:
        os.close(user_fd)


def _private_dir(parent_fd: int, name: str, shown: str, uid: int, create: bool) -> int:
    """Open (creating with 0700 when `create`) a directory that must be ours alone; its fd."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise SnapshotDirError(f"cannot create {shown}: {exc.strerror or exc}") from None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SnapshotDirError(f"{shown} is not a directory (a symlink or a file): not used") from None
        raise SnapshotDirError(f"cannot open {shown}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise SnapshotDirError(f"{shown} belongs to uid {st.st_uid}, not to this job's uid {uid}: not used")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)  # ours, but readable by others (made by hand?): close it
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_job_dir(root: str, job_id: str) -> bool:
    """Remove this user's empty job directory; False when it is not empty or not there."""
    uid = os.getuid()
    try:
        user_fd = os.open(os.path.join(root, user_dir_name(uid)), _DIR_FLAGS)
    except OSError:
        return False
    try:
        if os.fstat(user_fd).st_uid != uid:
            return False
        with contextlib.suppress(OSError):
            os.rmdir(job_dir_name(job_id), dir_fd=user_fd)
            return True
        return False
    finally:
        os.close(user_fd)
