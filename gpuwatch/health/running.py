"""The per-GPU state the daemon judges: each reading folded in once, each judgement in constant time.

The windowed reference (evidence.Windowed) rescans up to an hour of samples every tick. This keeps,
as readings arrive, just enough to answer the same Evidence questions without a rescan:

* `held`: per window length, the samples in the window (and the one before it) with running sums of
  the seconds and samples each condition held; a duty is a difference of two sums plus the clipped head;
* `falls`: the same with a running count of False → True steps;
* counter `growth`: only the samples where a counter rose (rare), with a running sum of the rises;
* events within the keep horizon, per kind (at most MAX_EVENTS each, in arrival order, which is time
  order: the kernel log's replay comes before any live event), so a rule reads the events of its
  kind and window walking back from the newest, never an hour of other kinds or older ones; read
  errors since the last good sample with a count per kind.

It follows the retention of the History the monitor used to keep (every reading within `keep_s` of
the newest one of its kind, and at least one), so both give the same findings at the same times; the
test tests/health/test_running.py runs both over every sim scenario and the real H200 trace. Held
seconds are summed in another order than the reference's, so they may differ in the last bits: a duty
within a microsecond of its threshold could tip the other way. Its size per GPU is bounded by each
window over the sampling interval plus the caps here; `nbytes` reports it. A restart starts it empty,
as it did the History: the state is a fold of readings (`add`), nothing of it is stored.
"""

from __future__ import annotations

import itertools
import math
import operator
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gpuwatch.health.evidence import Condition, Held, ReadErrors
from gpuwatch.health.history import History
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic

MAX_EVENTS = 4096  # per GPU and kind: an XID storm must not grow the daemon without bound
MAX_ERRORS = 8192  # per GPU, since its last good sample (an hour of failed reads at 1 s is 3600)

# (t, which conditions held, seconds each held so far, samples each held so far)
_HeldEntry = tuple[float, tuple[bool, ...], tuple[float, ...], tuple[int, ...]]


def _first_since(entries: deque[Any], start: float) -> int:
    """Index of the first entry at or after `start`; entries keep at most one before the window, so O(1)."""
    first, n = 0, len(entries)
    while first < n and entries[first][0] < start:
        first += 1
    return first


class _HeldWindow:
    """Every `held` condition of one window length, over that window's samples and the one before it."""

    def __init__(self, window_s: float, conditions: Sequence[Condition]) -> None:
        self.window_s = window_s
        self.position = {c.name: k for k, c in enumerate(conditions)}
        self.tests = tuple(c.test for c in conditions)
        self.entries: deque[_HeldEntry] = deque()
        self._none = tuple(False for _ in conditions)
        # When each condition last held, and any of them: one that held on no kept sample (the usual case)
        # answers at once, and so does the whole window when none did.
        self._last_true = [-math.inf for _ in conditions]
        self.latest_true = -math.inf
        self.oldest_t = math.inf  # the oldest kept sample's time
        self.zero = Held(0.0, 0, window_s)

    def add(self, sample: GpuSample) -> None:
        t, entries = sample.t, self.entries
        flags = tuple([bool(test(sample)) for test in self.tests])
        if flags == self._none:
            flags = self._none
        if not entries:
            seconds, counts = tuple(0.0 for _ in flags), tuple(int(f) for f in flags)
        elif flags is self._none:  # the usual case: nothing held, the sums carry over unchanged
            _, _, seconds, counts = entries[-1]
        else:
            previous_t, _, seconds, counts = entries[-1]
            dt = t - previous_t
            seconds = tuple(s + dt if f else s for s, f in zip(seconds, flags, strict=True))
            counts = tuple(c + 1 if f else c for c, f in zip(counts, flags, strict=True))
        if flags is not self._none:
            self._last_true = [t if f else last for f, last in zip(flags, self._last_true, strict=True)]
            self.latest_true = t
        entries.append((t, flags, seconds, counts))
        horizon = t - self.window_s
        while len(entries) > 1 and entries[1][0] < horizon:
            entries.popleft()
        self.oldest_t = entries[0][0]

    def held(self, name: str, now: float, kept_from: float) -> Held:
        """As evidence.held: each sample vouches for the time since the one before it, clipped to the window."""
        k, entries = self.position[name], self.entries
        if not entries or self._last_true[k] < entries[0][0]:
            return self.zero  # no kept sample shows it: what the sums below would give
        start = now - self.window_s
        first, n = _first_since(entries, start), len(entries)
        # The sample before the window counts only while the reference History would still keep it.
        before = first > 0 and (first == n or entries[first - 1][0] >= kept_from)
        seconds, count = 0.0, 0
        if before:
            count += entries[first - 1][1][k]
        if first < n:
            head, last = entries[first], entries[-1]
            count += last[3][k] - head[3][k] + head[1][k]
            seconds = last[2][k] - head[2][k]
            if before and head[1][k]:
                seconds = (head[0] - start) + seconds
        return Held(seconds, count, self.window_s)


class _FallsWindow:
    """One `falls` condition: the window's samples with a running count of False → True steps."""

    def __init__(self, condition: Condition) -> None:
        self.window_s = condition.window_s
        self.test = condition.test
        self.entries: deque[tuple[float, bool | None, int]] = deque()

    def add(self, sample: GpuSample) -> None:
        state, entries = self.test(sample), self.entries
        falls = 0
        if entries:
            _, previous, falls = entries[-1]
            falls += bool(state) and previous is False
        entries.append((sample.t, state, falls))
        horizon = sample.t - self.window_s
        while len(entries) > 1 and entries[1][0] < horizon:
            entries.popleft()

    def falls(self, now: float) -> int:
        """As the reference: steps into True from a False sample, both within the window."""
        entries = self.entries
        first = _first_since(entries, now - self.window_s)
        return entries[-1][2] - entries[first][2] if first < len(entries) else 0


class _Growth:
    """One counter: the samples where it rose within its window, with a running sum of the rises."""

    def __init__(self, condition: Condition) -> None:
        self.field = condition.name
        self.window_s = condition.window_s
        self.previous: int | None = None
        self.rises: deque[tuple[float, float, int, int]] = deque()  # (t, t of the sample before, rise, sum so far)
        self.total = 0

    def add(self, t: float, previous_t: float | None, value: int | None) -> None:
        """The counter's value at a sample taken at `t`; `previous_t`: the sample before it (None: the first)."""
        previous = self.previous
        if previous_t is not None and value is not None and previous is not None and value > previous:
            self.total += value - previous
            self.rises.append((t, previous_t, value - previous, self.total))
        self.previous = value
        self.forget(t)

    def forget(self, t: float) -> None:
        """Drop the rises older than the window before `t`."""
        horizon = t - self.window_s
        while self.rises and self.rises[0][0] < horizon:
            self.rises.popleft()

    def growth(self, now: float, kept_from: float) -> int:
        """As evidence.growth: rises dated within the window whose sample before is still kept."""
        rises, start = self.rises, now - self.window_s
        first, n = 0, len(self.rises)
        while first < n and (rises[first][0] < start or rises[first][1] < kept_from):
            first += 1
        if first == n:
            return 0
        _, _, rise, total = rises[first]
        return self.total - total + rise


class RunningState:
    """One GPU's readings folded into what its rules judge; `at(now)` is the Evidence for a judgement.

    `keep_s` is how far back the reference History kept readings (the longest window plus slack); it
    must exceed every condition's window.
    """

    def __init__(self, static: GpuStatic, conditions: Iterable[Condition], keep_s: float) -> None:
        conditions = tuple(conditions)
        if any(c.window_s >= keep_s for c in conditions):
            raise ValueError(f"keep_s {keep_s:g} must exceed every rule window")
        self.static = static
        self.keep_s = keep_s
        self.last: GpuSample | None = None
        self.last_error: GpuError | None = None
        self.seen = False
        by_window: dict[float, list[Condition]] = {}
        for c in conditions:
            if c.kind == "held":
                by_window.setdefault(c.window_s, []).append(c)
        self._held_windows = [_HeldWindow(window_s, group) for window_s, group in by_window.items()]
        self._held = {name: w for w in self._held_windows for name in w.position}
        self._falls = {c.name: _FallsWindow(c) for c in conditions if c.kind == "falls"}
        self._growth = {c.name: _Growth(c) for c in conditions if c.kind == "growth"}
        # Every counter read at once: a sample where none moved (the usual case) only ages the rises.
        names = tuple(self._growth)
        self._counters: Callable[[GpuSample], tuple[Any, ...]] = (
            (lambda s: (getattr(s, names[0]),)) if len(names) == 1 else operator.attrgetter(*names)
        )
        self._counter_values: tuple[Any, ...] | None = None
        self._events: dict[str, deque[GpuEvent]] = {}  # kind → its events, oldest first
        self._errors: deque[GpuError] = deque(maxlen=MAX_ERRORS)  # since the last good sample
        self._error_counts: Counter[str] = Counter()
        self._error_details: dict[str, str] = {}  # the newest detail of each kind counted

    def add(self, reading: GpuSample | GpuEvent | GpuError) -> None:
        self.seen = True
        if isinstance(reading, GpuSample):
            self._add_sample(reading)
        elif isinstance(reading, GpuEvent):
            events = self._events.setdefault(reading.kind, deque(maxlen=MAX_EVENTS))
            events.append(reading)
            horizon = reading.t - self.keep_s
            while events[0].t < horizon:
                events.popleft()
        else:
            self._add_error(reading)

    def _add_sample(self, sample: GpuSample) -> None:
        previous_t = None if self.last is None else self.last.t
        self.last = sample
        for held in self._held_windows:
            held.add(sample)
        for falls in self._falls.values():
            falls.add(sample)
        if self._growth:
            values = self._counters(sample)
            if values != self._counter_values:
                for growth, value in zip(self._growth.values(), values, strict=True):
                    growth.add(sample.t, previous_t, value)
                self._counter_values = values
            else:
                for growth in self._growth.values():
                    if growth.rises:
                        growth.forget(sample.t)
        errors = self._errors
        while errors and errors[0].t <= sample.t:  # judged only when newer than the last good sample
            self._forget_oldest_error()

    def _add_error(self, error: GpuError) -> None:
        self.last_error = error
        if self.last is not None and error.t <= self.last.t:
            return
        errors = self._errors
        if len(errors) == errors.maxlen:
            self._forget_oldest_error()
        errors.append(error)
        self._error_counts[error.kind] += 1
        self._error_details[error.kind] = error.detail
        horizon = error.t - self.keep_s
        while errors[0].t < horizon:
            self._forget_oldest_error()

    def _forget_oldest_error(self) -> None:
        kind = self._errors.popleft().kind
        self._error_counts[kind] -= 1
        if not self._error_counts[kind]:
            del self._error_counts[kind]
            self._error_details.pop(kind, None)

    def at(self, now: float) -> _At:
        return _At(self, now)

    def nbytes(self) -> int:
        """About how many bytes the state holds (containers and the objects only they hold)."""
        size = sys.getsizeof
        total = sum(size(kind) + sum(size(e) for e in kind) for kind in self._events.values())
        total += size(self._errors) + sum(size(e) for e in self._errors)
        if self.last is not None:
            total += size(self.last)
        for held in self._held_windows:
            total += size(held.entries)
            previous: _HeldEntry | None = None
            for entry in held.entries:
                total += size(entry) + size(entry[0])
                if previous is None or entry[2] is not previous[2]:  # sums shared with the entry before
                    total += size(entry[2]) + size(entry[3]) + sum(size(s) for s in entry[2])
                previous = entry
        for falls in self._falls.values():
            total += size(falls.entries) + sum(size(e) + size(e[0]) for e in falls.entries)
        for growth in self._growth.values():
            total += size(growth.rises) + sum(size(r) + 2 * size(r[0]) for r in growth.rises)
        return total


class _At:
    """RunningState's answers at `now`: the Evidence of one judgement."""

    def __init__(self, state: RunningState, now: float) -> None:
        self._state = state
        self._now = now
        last = state.last
        self.head = History(static=state.static, now=now, samples=(last,) if last is not None else ())
        # The oldest sample the reference History would still hold: `keep_s` before the newest one.
        self._kept_from = last.t - state.keep_s if last is not None else float("inf")

    def held(self, name: str) -> Held:
        window = self._state._held[name]
        if window.latest_true < window.oldest_t:  # no condition of its window held on a kept sample
            return window.zero
        return window.held(name, self._now, self._kept_from)

    def falls(self, name: str) -> int:
        return self._state._falls[name].falls(self._now)

    def growth(self, name: str) -> int:
        counter = self._state._growth[name]
        return counter.growth(self._now, self._kept_from) if counter.rises else 0

    def events_since(self, window_s: float, kind: str) -> Sequence[GpuEvent]:
        events = self._state._events.get(kind)
        if not events:
            return ()
        start = self._now - window_s
        newest_first = list(itertools.takewhile(lambda e: e.t >= start, reversed(events)))
        newest_first.reverse()
        return newest_first

    def read_errors(self) -> ReadErrors:
        if not self._state._errors:
            return _NO_ERRORS
        return ReadErrors(self._state._error_counts.copy(), dict(self._state._error_details))


_NO_ERRORS = ReadErrors(Counter(), {})
