"""Log lines rate-limited per source (a local user, a pid): one noisy account cannot flood the journal.

Each source may say LINES_PER_WINDOW lines per WINDOW_S; what it says beyond that is counted, and
the count is said once with its next line after the window has passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

LINES_PER_WINDOW = 5
WINDOW_S = 60.0
MAX_SOURCES = 4096  # beyond this many sources at once, the oldest windows are forgotten


class SourceLog:
    """`say(source, level, message, *args)`: log, unless this source has said enough for now."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.clock = clock
        self._windows: dict[Hashable, list[float | int]] = {}  # source → [window start, lines said, lines held]

    def say(self, source: Hashable, level: int, message: str, *args: object) -> None:
        now = self.clock()
        window = self._windows.get(source)
        if window is None or now - window[0] >= WINDOW_S:
            held = int(window[2]) if window is not None else 0
            if window is None and len(self._windows) >= MAX_SOURCES:
                self._windows.pop(next(iter(self._windows)))
            self._windows[source] = window = [now, 0, 0]
            if held:
                message += f" ({held} similar line(s) held back in the last {WINDOW_S:g} s)"
        if window[1] >= LINES_PER_WINDOW:
            window[2] += 1
            return
        window[1] += 1
        self.logger.log(level, message, *args)
