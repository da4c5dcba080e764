"""The runtime dir the ranks report to: the daemon's own, as it says over its control socket (GET /v1/daemon).

A rank that reports to another directory than the daemon's is invisible to it: a quarantine of its GPU
would not stop it. So launch never guesses the directory from its own config; one given by hand that is
not the daemon's is refused before anything starts.
"""

from __future__ import annotations

import os

from gpuwatch.errors import GpuwatchError


class RuntimeDirMismatch(GpuwatchError):
    """A runtime dir given by hand is not the daemon's: the job's reports would never reach it."""


def runtime_dir_for_ranks(daemon_dir: str, given: str | None, given_as: str) -> str:
    """The daemon's runtime dir; `given` (by hand, `given_as` names where) must be that same directory.

    Raises:
        RuntimeDirMismatch: `given` is another directory than the daemon's.
    """
    if given is None or os.path.realpath(given) == os.path.realpath(daemon_dir):
        return daemon_dir
    raise RuntimeDirMismatch(
        f"{given_as} {given} is not the daemon's runtime dir {daemon_dir}: the job's ranks could not report to it, "
        "and a quarantine of their GPU would not reach them; leave it out (launch asks the daemon)"
    )
