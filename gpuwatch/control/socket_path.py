"""The control socket's path: safe to trust (checked before connecting), and usable however long it is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuwatch.errors import DaemonError


class NoControlSocket(DaemonError):
    """Nothing at the control socket's path, or nothing answers there: the daemon is not running (there)."""


class NotTheDaemon(DaemonError):
    """Something is at the control socket's path that root did not put there, or could have been replaced."""


def trusted_uids() -> frozenset[int]:
    """Whose socket a client may believe: root's, and its own (a daemon the caller runs by hand)."""
    return frozenset({0, os.geteuid()})


def check(path: Path) -> None:
    """Refuse a control socket that someone other than root (or the caller) made or could have replaced.

    Raises:
        NoControlSocket: nothing there.
        NotTheDaemon: not a socket, owned by another user, or in a directory others may write to.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise NoControlSocket(f"no control socket at {path}") from None
    except OSError as exc:
        raise NoControlSocket(f"cannot look at {path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise NotTheDaemon(f"{path} is not a socket: refusing it as the daemon's control socket")
    if info.st_uid not in trusted_uids():
        raise NotTheDaemon(f"{path} belongs to uid {info.st_uid}, not root: refusing it, it is not the daemon's")
    directory = Path(os.path.realpath(path.parent))
    dir_info = os.stat(directory)
    open_to_others = dir_info.st_mode & 0o022 and not dir_info.st_mode & stat.S_ISVTX
    if dir_info.st_uid not in trusted_uids() or open_to_others:
        raise NotTheDaemon(
            f"{directory} is a directory others may write to (uid {dir_info.st_uid}, mode "
            f"{stat.S_IMODE(dir_info.st_mode):04o}): anyone could have put {path.name} there; refusing it"
        )
