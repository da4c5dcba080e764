"""A Unix socket's address for any path: sun_path holds 108 bytes, and a daemon's or a test's paths can be longer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL


@contextlib.contextmanager
def address(path: Path) -> Iterator[str]:
    """The address to bind or connect to: `path`, or for one too long for sun_path the same file reached
    through its directory's descriptor (/proc/self/fd/N/NAME), valid inside the `with`."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
