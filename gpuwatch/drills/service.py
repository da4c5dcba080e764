"""Drills inside the daemon: their record, their scheduled runs and their routes, wired in by install()."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from fastapi import FastAPI
from prometheus_client.core import Metric

from gpuwatch.config import Config, DrillSchedule
from gpuwatch.drills.daemon_client import HttpApi
from gpuwatch.drills.record import DrillRecord
from gpuwatch.drills.routes import add_routes
from gpuwatch.drills.scheduler import DrillScheduler
from gpuwatch.drills.steps import Clock, Interrupted
from gpuwatch.monitor import Monitor
from gpuwatch.store import Store


class Collector(Protocol):
    extras: list[Callable[[], Iterable[Metric]]]


class DaemonParts(Protocol):
    """What install() uses of gpuwatch.daemon.Daemon (which sits above this package)."""

    config: Config
    monitor: Monitor
    store: Store
    clock: Callable[[], float]
    scheduler: Any  # apscheduler's BackgroundScheduler: only drills.scheduler may name APScheduler
    stop_event: threading.Event
    route_hooks: list[Callable[[FastAPI, Callable[..., None]], None]]
    key_parts: list[Callable[[], object]]

    @property
    def collector(self) -> Collector: ...


class DrillService:
    """The drills of one daemon: its record, its scheduled runs and its routes."""

    def __init__(self, daemon: DaemonParts) -> None:
        self.daemon = daemon
        self.book = DrillRecord(daemon.store)
        clock = Clock(daemon.clock, self._sleep, daemon.config.drills.poll_s)
        self.drills = DrillScheduler(daemon.config, lambda: HttpApi(daemon.config), self.book, clock)

    def _sleep(self, seconds: float) -> None:
        if self.daemon.stop_event.wait(seconds):
            raise Interrupted("the daemon is stopping")

    def submit(self, schedule: DrillSchedule) -> None:
        self.drills.submit(self.daemon.scheduler, schedule)

    def routes(self, app: FastAPI, require_token: Callable[..., None]) -> None:
        add_routes(app, require_token, self.daemon.monitor, self.book, self.drills, self.submit)


def install(daemon: DaemonParts) -> None:
    """Add drill routes, metrics, the render-cache key and scheduled drills to `daemon`. Twice is once.

    Raises:
        ConfigError: a `[[drills.schedule]]` entry is wrong (named in the message).
    """
    if any(isinstance(getattr(hook, "__self__", None), DrillService) for hook in daemon.route_hooks):
        return
    service = DrillService(daemon)
    daemon.route_hooks.append(service.routes)
    daemon.collector.extras.append(service.book.collect)
    daemon.key_parts.append(service.book.key)
    service.drills.add_jobs(daemon.scheduler)
