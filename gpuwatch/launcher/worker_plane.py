"""A one-node launch's worker plane: the secret its agent's store and its workers share, and their entry.

Torch-free (`gpuwatch launch` starts without torch): the launcher writes a fresh secret for each
launch into its own 0700 directory and names the file in $GPUWATCH_WORKER_SECRET_FILE; torchrun's
agent (gpuwatch.launcher.local_rendezvous) hosts the workers' store behind it, and each worker starts
through gpuwatch.launcher.worker_store, which proves it before the job's group carries anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

WORKER_SECRET_ENV = "GPUWATCH_WORKER_SECRET_FILE"
# Run in each worker before the job. `python -c` puts the working directory first on sys.path, so it
# goes before anything is imported: a module another user left there must never run as the job's user.
_ENTRY = "import sys; sys.path.pop(0); from gpuwatch.launcher.worker_store import main; sys.exit(main(sys.argv[1:]))"


def secured_job_args(command: Sequence[str], python: str) -> list[str]:
    """torchrun's arguments that start each worker through gpuwatch.launcher.worker_store, then the job.

    `--no-python` makes `python` itself the entry point; the job's `[-m] SCRIPT ARGS` follow as the
    entry's arguments, which it runs as `python [-m] SCRIPT ARGS` would.
    """
    return ["--no-python", "--", python, "-u", "-c", _ENTRY, *command]


def write_secret(path: Path) -> Path:
    """32 fresh random bytes (hex) in a new file at `path`, 0600, never through a link; `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(os.urandom(32).hex() + "\n")
    return path
