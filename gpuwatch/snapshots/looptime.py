"""What snapshots cost the training loop's wall time, from the loop's own step intervals.

`HostSnapshot.step` is called once a step, so the time between two calls is one step as the loop
lived it. Each interval is either plain (no snapshot in flight) or paid for by a snapshot (one was
in flight: its copies competed with the step, its boundary and drain ran inside it).

* a snapshot's cost: its intervals less as many typical (median) plain steps; robust to a stray slow
  step, it is what `every="auto"` first chooses K from;
* the wall-time share: over the recent steps since snapshots run, their mean interval against the
  mean of the plain ones among them, less one. Means: the wall time is a sum, and the slow plain
  steps a loop has anyway (a collection, a log line) are in both kinds alike. That is the figure
  `stats()` reports as cost_share, and "auto" raises K while it is over its share.

Steps while the slots are set up are neither (the set-up's own work is off the step, but not free):
the plain mean is measured once snapshots can run.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

SNAPSHOTS = 8
"""Snapshots whose costs are kept (their mean is what "auto" chooses K from)."""
WINDOW_STEPS = 1000
"""Recent intervals since snapshots run, plain or not: the plain step and the share are measured over these
(one population: the plain mean of other steps than the share's would carry their drift into it)."""


class LoopTime:
    """The loop's step intervals, plain or with a snapshot in flight, and what the snapshots added to them."""

    def __init__(self) -> None:
        self.window: deque[tuple[float, bool]] = deque(maxlen=WINDOW_STEPS)  # (interval, a snapshot in flight)
        self._sum = self._plain_sum = 0.0  # of the window's intervals, and of its plain ones
        self._plain_n = 0
        self.costs: deque[float] = deque(maxlen=SNAPSHOTS)  # each snapshot's excess over as many plain steps
        self.hosts: deque[float] = deque(maxlen=SNAPSHOTS)  # of that, the training thread's time inside step
        self.drains: deque[float] = deque(maxlen=SNAPSHOTS)  # boundary to commit, per snapshot
        self.since_restart = 0  # intervals recorded since the cadence last changed
        self._last_t: float | None = None
        self.last_interval: float | None = None  # the latest step's, of any kind (the set-up's steps too)

    def tick(self, now: float) -> float | None:
        """The interval since the previous call (None at the first)."""
        interval = None if self._last_t is None else now - self._last_t
        self._last_t = now
        if interval is not None:
            self.last_interval = interval
        return interval

    def record(self, interval: float, *, in_flight: bool) -> None:
        """One step's interval once snapshots can run: plain, or paid for by the snapshot in flight."""
        if len(self.window) == self.window.maxlen:
            self._drop(*self.window[0])
        self.window.append((interval, in_flight))
        self._sum += interval
        if not in_flight:
            self._plain_sum += interval
            self._plain_n += 1
        self.since_restart += 1

    def _drop(self, interval: float, in_flight: bool) -> None:
        self._sum -= interval
        if not in_flight:
            self._plain_sum -= interval
            self._plain_n -= 1

    @property
    def plain_steps(self) -> int:
        return self._plain_n

    def plain_step(self) -> float | None:
        """The mean plain step over the window (None until one was seen)."""
        return self._plain_sum / self._plain_n if self._plain_n else None

    def mean_step(self) -> float | None:
        """The mean interval over the window, plain or not (a cadence with a snapshot always in flight has no
        plain step)."""
        return self._sum / len(self.window) if self.window else None

    def median_plain_step(self, recent: int | None = None) -> float | None:
        """The typical plain step (of the last `recent` steps: what a drain portion is sized against)."""
        steps = itertools.islice(reversed(self.window), recent) if recent else self.window  # once a step: no copy
        plain = [interval for interval, in_flight in steps if not in_flight]
        return statistics.median(plain) if plain else None

    def snapshot_done(self, intervals: list[float], host_s: float, drain_s: float) -> float | None:
        """Account a committed snapshot's intervals; what it cost the loop (None without a plain step yet)."""
        self.drains.append(drain_s)
        plain = self.median_plain_step()
        if plain is None or not intervals:
            return None
        cost = sum(intervals) - plain * len(intervals)
        self.costs.append(cost)
        self.hosts.append(host_s)
        return cost

    def mean_cost(self) -> float | None:
        return statistics.fmean(self.costs) if self.costs else None

    def mean_host(self) -> float | None:
        return statistics.fmean(self.hosts) if self.hosts else None

    def median_drain(self) -> float | None:
        return statistics.median(self.drains) if self.drains else None

    def wall_share(self) -> float | None:
        """The recent steps' mean interval against the plain mean, less one (None before a snapshot is measured)."""
        plain = self.plain_step()
        if not plain or not self.costs or not self.window:
            return None
        return self._sum / len(self.window) / plain - 1

    def restart_window(self) -> None:
        """The cadence changed: count the steps at the new one (the window keeps the recent steps, so that
        the share is still reported meanwhile)."""
        self.since_restart = 0
