"""Drills inside the daemon: their record, their scheduled runs and their routes, built by the daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuwatch.config import Config, DrillSchedule
from gpuwatch.drills.daemon_client import HttpApi
from gpuwatch.drills.record import DrillRecord
from gpuwatch.drills.scheduler import DrillScheduler
from gpuwatch.drills.steps import Clock, Interrupted
from gpuwatch.node.monitor import Monitor
from gpuwatch.node.store import Store

if TYPE_CHECKING:
    from fastapi import FastAPI


class DrillService:
    """The drills of one daemon: `record` (a Collector and a render-cache key), scheduled runs, routes.

    A scheduled drill talks to its own daemon over HTTP, as an operator's drill does, so it proves
    the same chain (finding, /metrics, quarantine, incident) the outside world sees.
    """

    def __init__(
        self,
        config: Config,
        monitor: Monitor,
        store: Store,
        *,
        scheduler: Any,  # apscheduler's BackgroundScheduler: only drills.scheduler names APScheduler
        clock: Callable[[], float],
        stop: threading.Event,
    ) -> None:
        """Raises ConfigError when a `[[drills.schedule]]` entry is wrong (named in the message)."""
        self.monitor = monitor
        self.record = DrillRecord(store)
        self._scheduler = scheduler
        self._stop = stop
        drill_clock = Clock(clock, self._sleep, config.drills.poll_s)
        self.drills = DrillScheduler(config, lambda: HttpApi(config), self.record, drill_clock)

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise Interrupted("the daemon is stopping")

    def add_jobs(self) -> None:
        """Add the `[[drills.schedule]]` cron jobs to the daemon's scheduler (it runs on-demand drills too)."""
        self.drills.add_jobs(self._scheduler)

    def submit(self, schedule: DrillSchedule) -> None:
        self.drills.submit(self._scheduler, schedule)

    def routes(self, app: FastAPI, require_token: Callable[..., None]) -> None:
        from gpuwatch.drills.routes import add_routes  # FastAPI's: imported with the API, at its first request

        add_routes(app, require_token, self.monitor, self.record, self.drills, self.submit)
