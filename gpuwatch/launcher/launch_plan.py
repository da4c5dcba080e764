"""What one `gpuwatch launch` through torchrun is given, and how it ends other than by success.

Locking: none. A Plan is frozen; a LaunchStopped is raised once, in the launch loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMAND = "gpuwatch launch"  # the start of its error lines
EXIT_STOPPED = 3


class LaunchStopped(Exception):
    """The launcher's end other than success: one line, and the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Plan:
    """Everything a launch needs besides the GPUs: counts, limits, identity, torchrun's arguments."""

    nproc: int | None  # None: every usable GPU
    min_nproc: int
    max_restarts: int
    runtime_dir: str
    job_id: str
    rendezvous: tuple[str, ...]
    command: tuple[str, ...]
    stop_grace_s: float = 60.0  # the daemon's trainer.grace_period_s (GET /v1/daemon)
    watch_poll_s: float = 1.0  # how often QuarantineWatch asks the daemon
