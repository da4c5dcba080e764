"""The in-place job's secret: what its launchers and ranks prove to each other at the job's store.

A one-node launch makes its own (32 random bytes) in a directory only its user can enter; several
nodes share one in a file the user owns (`--inplace-secret-file`, made e.g. with
`(umask 077; openssl rand -hex 32 > ~/.job.secret)` on a shared home). The workers find the file's
path in SECRET_FILE_ENV: a path is no secret, and the file is readable by its owner alone (argv is
readable by every user of the node; the secret itself never goes there or into the environment).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from gpuwatch.errors import InPlaceError

SECRET_FILE_ENV = "GPUWATCH_INPLACE_SECRET_FILE"
_MIN_BYTES = 16
_MAX_FILE = 4096


class SecretError(InPlaceError, ValueError):
    """The secret file cannot be trusted or read: one line naming the file and why."""


def new_secret_file() -> Path:
    """A fresh secret in a new directory only this user can enter (0700, file 0600); remove its parent after."""
    directory = Path(tempfile.mkdtemp(prefix="gpuwatch-inplace-"))
    path = directory / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(os.urandom(32).hex() + "\n")
    return path


def read_secret(path: str | Path) -> bytes:
    """The secret in `path`: a regular file of this user's that group and others can neither read nor write.

    Raises:
        SecretError: a link, a FIFO, another user's file, a file others can read, too short or too long.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise SecretError(f"secret file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret file {path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretError(f"secret file {path}: belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise SecretError(f"secret file {path}: mode {stat.S_IMODE(st.st_mode):o}: others may read it (chmod 600)")
        if st.st_size > _MAX_FILE:
            raise SecretError(f"secret file {path}: {st.st_size} bytes, more than {_MAX_FILE}")
        secret = file.read(_MAX_FILE).strip()
    if len(secret) < _MIN_BYTES:
        raise SecretError(f"secret file {path}: {len(secret)} bytes, fewer than {_MIN_BYTES}")
    return secret
