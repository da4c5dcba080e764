"""The API token in `<state_dir>/token`: what a POST must carry to change state."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from gpuwatch.errors import ConfigError

log = logging.getLogger("gpuwatch.api")


def ensure_token(path: Path, *, first_start: bool = True) -> str:
    """The API token, created 0600 on first start so only root (and the CLI run as root) can change state.

    An existing token is used only if it is a regular file of ours that group and others cannot
    read (anyone who can read it can quarantine GPUs). A token missing after the first start is
    minted anew with a warning: clients holding the old one must read the new one.

    Raises:
        ConfigError: one line naming the path, for a token that is not a private regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        fd = -1
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the API token: {exc.strerror or exc}") from None
    if fd >= 0:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ConfigError(f"{path}: the API token is not a regular file")
        with os.fdopen(fd, "rb") as existing:
            raw = existing.read(4096)
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            token = ""
        if token and (info.st_uid != os.geteuid() or info.st_mode & 0o077):
            raise ConfigError(
                f"{path}: the API token is readable or owned by others (mode {stat.S_IMODE(info.st_mode):04o}, "
                f"uid {info.st_uid}): remove it to mint a new one, or chmod 600 it"
            )
        if token:
            return token
        log.warning("%s: the API token is empty or not text; minting a new one", path)
        path.unlink()  # an empty token (a crash mid-write) would let an empty bearer through
    elif not first_start:
        log.warning("%s: the API token was missing; minted a new one (clients must read it again)", path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(token + "\n")
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the API token: {exc.strerror or exc}") from None
    return token
