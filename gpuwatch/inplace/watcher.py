"""The engine's slower checks on a thread of their own: status.json, read every `tick_s`.

The generations are not polled here: the job's store pushes them (gpuwatch.inplace.membership). What
is left to look at is the daemon's status.json, whose quarantine of this rank's GPU makes it leave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("gpuwatch.inplace")

STATUS_S = 0.25  # how often status.json's mtime is looked at


class Ticker:
    """Runs `on_tick` every `tick_s` until closed; an error in it is logged at debug level and the thread goes on."""

    def __init__(self, on_tick: Callable[[], None], *, tick_s: float = STATUS_S) -> None:
        self._on_tick, self._tick_s = on_tick, tick_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-inplace-status", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self._tick_s):
            try:
                self._on_tick()
            except Exception as exc:  # the runtime dir may be gone at the job's end; training goes on
                log.debug("in-place status check: %s", exc)
