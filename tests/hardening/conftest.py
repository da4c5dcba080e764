"""Fixtures for the hardening tests: other local users, read-only and full file systems, made for real."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[bool]:
    """Mount a tmpfs of `size` at `path` (root only); yields False where mount is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if not can_mount():
        yield False
        return
    opts = ",".join((f"size={size}", "mode=0755", *options))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, *options: str) -> None:
    subprocess.run(["mount", "-o", ",".join(("remount", *options)), str(path)], check=True, capture_output=True)


@contextlib.contextmanager
def local_users(*names: str) -> Iterator[list[pwd.struct_passwd]]:
    """Throwaway local accounts made by useradd (a leftover of an earlier run is made anew), removed at the end.

    Each name gets this process's pid, so parallel workers (pytest -n) and other runs never share an account."""
    names = tuple(f"{name}-{os.getpid()}" for name in names)
    for name in names:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["userdel", name], check=True, capture_output=True)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield [pwd.getpwnam(name) for name in names]
    finally:
        for name in names:
            subprocess.run(["userdel", name], check=False, capture_output=True)
