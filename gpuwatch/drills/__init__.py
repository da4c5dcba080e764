"""Fault-injection drills: inject a fault, then prove that detection, the alert metric, quarantine,
the trainers' checkpoint and the job's resume all follow, each within its deadline.

`install(daemon)` wires drills into a daemon (routes, metrics, scheduled runs); `gpuwatch.drills.cli.drill`
is the `gpuwatch drill` command. Both import their heavy parts (FastAPI, APScheduler) only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatch.drills.service import DaemonParts


def install(daemon: DaemonParts) -> None:
    """Add drill routes, metrics, the render-cache key and scheduled drills to `daemon`. Twice is once.

    Raises:
        ConfigError: a `[[drills.schedule]]` entry is wrong (named in the message).
    """
    from gpuwatch.drills.service import install as install_service

    install_service(daemon)
