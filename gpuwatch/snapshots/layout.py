"""Where host snapshots live, and opening their directories without trusting the world-writable /dev/shm.

    /dev/shm/gpuwatch-<uid>/                 0700, owned by <uid>: one per user, created by the first job
        job-<job id>/                        0700: one per job (its TORCHELASTIC_RUN_ID or GPUWATCH_JOB_ID)
            rank-00000.slot0, rank-00000.slot1   0600: each rank's two slots

Another local user can create `/dev/shm/gpuwatch-<uid>` before the job does (a directory of
theirs, a symlink, a file): so every directory is opened with O_NOFOLLOW, checked to be a directory
owned by this process's uid with no group or other access, and used through its file descriptor
from then on (dir_fd), so a rename or a symlink swapped in later changes nothing.

When the predictable name is taken by someone else, the user's directory is a fresh
`gpuwatch-<uid>-<16 random hex digits>` instead, made with mkdir (which fails on any existing name)
and checked by fstat on its fd like the other. A directory owned by this uid can only have been
made by this uid (or root), so a relaunch finds its slots again by looking for such a directory:
the lowest-named one this uid owns. Nobody else can read it (0700) or take its name beforehand
(it is drawn at random). The daemon counts the squat on its metrics and removes it where that is
safe (a link, a file, an empty directory).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import stat

from gpuwatch.errors import SnapshotError

DEFAULT_ROOT = "/dev/shm"
ROOT_ENV = "GPUWATCH_SNAPSHOT_ROOT"
"""Where the per-user directories go (default /dev/shm): a tmpfs that outlives the process, cleared at reboot."""

log = logging.getLogger("gpuwatch.snapshots")

_USER_DIR = re.compile(r"^gpuwatch-(0|[1-9][0-9]{0,9})(-[0-9a-f]{16})?$")
_JOB_DIR = re.compile(r"^job-([A-Za-z0-9][A-Za-z0-9._-]{0,127})$")
_SLOT_FILE = re.compile(r"^rank-([0-9]{5,7})\.slot([01])(?:\.tmp)?$")
_SAFE_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
SLOTS = (0, 1)

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class SnapshotDirError(SnapshotError):
    """The snapshot directory cannot be used safely; the message is the one-line reason."""


def snapshot_root() -> str:
    """The root the per-user directories are in: $GPUWATCH_SNAPSHOT_ROOT, else /dev/shm."""
    return os.environ.get(ROOT_ENV) or DEFAULT_ROOT


def user_dir_name(uid: int) -> str:
    return f"gpuwatch-{uid}"


def user_of(name: str) -> int | None:
    """The uid a per-user directory name is for (user_dir_name's or a fallback's), else None."""
    match = _USER_DIR.match(name)
    return int(match.group(1)) if match else None


def is_fallback_name(name: str) -> bool:
    """Whether `name` is a per-user directory of random name (`gpuwatch-<uid>-<hex>`): the plain one was taken."""
    match = _USER_DIR.match(name)
    return match is not None and match.group(2) is not None


class _Taken(SnapshotDirError):
    """The name exists but is not this uid's directory: another user's squat (or a stray file)."""


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

    The user's directory is `gpuwatch-<uid>`, or when another user holds that name, this uid's
    random fallback (see the module doc).

    Raises:
        SnapshotDirError: root is missing, or no directory of this uid that only it can enter can be
            opened or created there. The message names the path and what is wrong with it.
    """
    uid = os.getuid()
    try:
        root_fd = os.open(root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))  # the root itself may be a link (/dev/shm)
    except OSError as exc:
        raise SnapshotDirError(f"{root}: {exc.strerror or exc}") from None
    try:
        user_fd, user_name = _user_dir(root_fd, root, uid, create)
    finally:
        os.close(root_fd)
    try:
        name = job_dir_name(job_id)
        return _private_dir(user_fd, name, f"{root}/{user_name}/{name}", uid, create)
    finally:
        os.close(user_fd)


def _user_dir(root_fd: int, root: str, uid: int, create: bool) -> tuple[int, str]:
    """This uid's directory under the root (fd, name): `gpuwatch-<uid>`, else its fallback when that is taken.

    An existing fallback is used even once the plain name is free again: it holds the job's slots.
    """
    name = user_dir_name(uid)
    taken = False
    try:
        return _private_dir(root_fd, name, f"{root}/{name}", uid, False), name
    except _Taken as exc:
        taken = True
        log.warning("%s; host snapshots go to a private directory of random name instead", exc)
    except SnapshotDirError:
        pass  # not there (yet)
    for candidate in _fallback_names(root_fd, uid):
        with contextlib.suppress(SnapshotDirError):
            return _private_dir(root_fd, candidate, f"{root}/{candidate}", uid, False), candidate
    if not create:
        raise SnapshotDirError(f"no directory of uid {uid} in {root}")
    if not taken:
        try:
            return _private_dir(root_fd, name, f"{root}/{name}", uid, True), name
        except _Taken as exc:  # made by someone else between the two looks
            log.warning("%s; host snapshots go to a private directory of random name instead", exc)
    mine = _make_fallback(root_fd, root, uid)
    chosen = _fallback_names(root_fd, uid)[0]  # another rank of the job may have made one meanwhile: the lowest wins
    if chosen != mine:
        with contextlib.suppress(OSError):
            os.rmdir(mine, dir_fd=root_fd)
    return _private_dir(root_fd, chosen, f"{root}/{chosen}", uid, False), chosen


def names_in(dir_fd: int) -> list[str]:
    """The names in the directory open as `dir_fd`, read through a descriptor of their own.

    os.listdir(fd) reads through a duplicate that shares the descriptor's offset, so two listings of one
    directory descriptor at once (two threads of a rank) each see part of it: with four threads listing
    3,000 names, 85 of 120 listings came back short.
    """
    own = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.listdir(own)
    finally:
        os.close(own)


def _fallback_names(root_fd: int, uid: int) -> list[str]:
    """Random-named directories under the root that this uid owns (it made them), lowest name first."""
    found = []
    for name in names_in(root_fd):
        if is_fallback_name(name) and user_of(name) == uid:
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                    found.append(name)
    return sorted(found)


def _make_fallback(root_fd: int, root: str, uid: int) -> str:
    """mkdir a fresh `gpuwatch-<uid>-<random>` (0700): mkdir fails on any name that exists, so it is new and ours."""
    for _ in range(8):
        name = f"{user_dir_name(uid)}-{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
            return name
        except FileExistsError:
            continue
        except OSError as exc:
            raise SnapshotDirError(f"cannot create {root}/{name}: {exc.strerror or exc}") from None
    raise SnapshotDirError(f"cannot create a directory of random name in {root}")


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
            raise _Taken(f"{shown} is not a directory (a symlink or a file): not used") from None
        raise SnapshotDirError(f"cannot open {shown}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise _Taken(f"{shown} belongs to uid {st.st_uid}, not to this job's uid {uid}: not used")
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
        root_fd = os.open(root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        user_fd, _ = _user_dir(root_fd, root, uid, create=False)
    except SnapshotDirError:
        return False
    finally:
        os.close(root_fd)
    try:
        with contextlib.suppress(OSError):
            os.rmdir(job_dir_name(job_id), dir_fd=user_fd)
            return True
        return False
    finally:
        os.close(user_fd)
