"""The membership watcher: a thread that follows the newest generation in the job's store for one rank.

The step engine reads `latest` at each step boundary, so all ranks switch at the same step, and is
called back (`on_generation`) as soon as a new generation is published, while its main thread may be
blocked in a collective (NCCL must then be aborted from here). `on_tick` runs every `tick_s` for the
engine's slower checks (status.json). How the newest generation is read is `latest_generation`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuwatch.inplace.protocol import Store, latest_generation

log = logging.getLogger("gpuwatch.inplace")

WATCH_S = 0.02  # how often the newest generation is read


class Watcher:
    """Follows the newest generation on its own thread (a store connection of its own: the main one may block)."""

    def __init__(
        self,
        store: Store,
        on_generation: Callable[[int], None],
        on_tick: Callable[[], None],
        *,
        tick_s: float = 0.25,
    ) -> None:
        self.latest = 0
        self._store, self._on_generation, self._on_tick, self._tick_s = store, on_generation, on_tick, tick_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-inplace-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        next_tick = 0.0
        while not self._closed.wait(WATCH_S):
            try:
                latest = latest_generation(self._store)
                if latest != self.latest:
                    self.latest = latest
                    self._on_generation(latest)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._tick_s
                    self._on_tick()
            except Exception as exc:  # the store may be gone at the job's end; training goes on
                log.debug("in-place watcher: %s", exc)
