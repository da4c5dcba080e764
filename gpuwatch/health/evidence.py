"""What the rules judge, and the arithmetic they share: how long a condition held, how much a counter grew.

A rule is written once against `Evidence`. Two things answer it: `Windowed`, the reference, which
rescans a History (held, growth, the events and errors in it) and whose cost grows with the window;
and `running.RunningState`, updated once per reading, which answers the same questions in constant
time. Each rule declares the per-sample `Condition`s it needs, so the running state can fold them in
as samples arrive.

Every measure here is in seconds of the window, never in sample counts, so a rule means the same
at a 1 s and at a 30 s sampling interval.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from operator import attrgetter
from typing import Literal, Protocol

from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuEvent, GpuSample, Severity

# A sustained condition needs at least this many samples showing it: one reading is never a trend
# (HW slowdown, for one, "may be also reported during PState or clock change").
MIN_SAMPLES = 2


@dataclass(frozen=True)
class Held:
    """How much of the last `window_s` seconds a condition held, and on how many samples."""

    seconds: float
    samples: int
    window_s: float

    @property
    def share(self) -> float:
        return self.seconds / self.window_s

    def sustained(self, duty: float) -> bool:
        """True when it held for at least `duty` of the whole window, on at least MIN_SAMPLES samples."""
        return self.samples >= MIN_SAMPLES and self.seconds >= duty * self.window_s

    def describe(self) -> str:
        return f"{self.share:.0%} of the last {self.window_s:g} s"


def held(history: History, window_s: float, condition: Callable[[GpuSample], bool]) -> Held:
    """Measure `condition` over the last `window_s` seconds.

    Each sample vouches for the time since the sample before it (clipped to the window); the oldest
    sample in the history vouches for nothing. The share is of the whole window, so a daemon that has
    watched for 10 s cannot claim a condition held for half of the last minute. The samples counted
    are those in the window and the one just before it, whose interval the window's first one shares:
    so a window as short as the sampling interval can still see two readings agree.
    """
    start = history.now - window_s
    first = history.first_since(window_s)
    seconds, count = 0.0, 0
    previous: float | None = None
    if first > 0:
        before = history.samples[first - 1]
        previous, count = before.t, int(condition(before))
    for sample in history.samples[first:]:
        if condition(sample):
            count += 1
            if previous is not None:
                seconds += sample.t - max(previous, start)
        previous = sample.t
    return Held(seconds, count, window_s)


def growth(history: History, window_s: float, counter: str) -> int:
    """How much the sample field `counter` grew within the last `window_s` seconds.

    Growth is the sum of increases between consecutive samples, dated at the later one, so a counter
    that rose before the window no longer counts, and a reset to a lower value (GPU reset clears the
    volatile ECC counters) is not growth. The baseline, the first sample ever taken, is the step before
    the oldest kept sample only while it lies inside the window itself: older than that, the samples
    between it and the kept ones are gone and any increase may predate the window.
    """
    first = history.first_since(window_s)
    samples = history.samples[max(first - 1, 0) :]
    base = history.baseline
    if first == 0 and base is not None and base.t >= history.now - window_s and (not samples or base.t < samples[0].t):
        samples = (base, *samples)
    values = list(map(attrgetter(counter), samples))
    if not values or values.count(values[0]) == len(values):
        return 0  # the usual case, found at C speed: a counter that never moved
    total = 0
    for old, new in pairwise(values):
        if old is not None and new is not None and new > old:
            total += new - old
    return total


@dataclass(frozen=True)
class Condition:
    """A per-sample test a rule judges over the last `window_s` seconds, by name.

    kind `held`: how long `test` held (`Evidence.held`); `falls`: how often `test` went from False
    straight to True (`Evidence.falls`); `growth`: how much the sample field `name` grew (`Evidence.growth`).
    """

    name: str
    kind: Literal["held", "falls", "growth"]
    window_s: float
    test: Callable[[GpuSample], bool | None] = field(default=lambda sample: None, compare=False)


@dataclass(frozen=True)
class ReadErrors:
    """Failed reads newer than the last good sample: how many of each kind, and the last detail of each kind."""

    counts: Counter[str]
    details: dict[str, str]


class Evidence(Protocol):
    """What a rule may know about one GPU at `head.now`; `head` stamps findings (static, now, last sample)."""

    @property
    def head(self) -> History: ...

    def held(self, name: str) -> Held: ...

    def falls(self, name: str) -> int: ...

    def growth(self, name: str) -> int: ...

    def events_since(self, window_s: float, kind: str) -> Sequence[GpuEvent]:
        """The events of `kind` within the last `window_s`, oldest first."""
        ...

    def read_errors(self) -> ReadErrors: ...


class Windowed:
    """The reference Evidence: every answer rescans the History (cost grows with the window)."""

    def __init__(self, history: History, conditions: Iterable[Condition]) -> None:
        self.head = history
        self._conditions = {c.name: c for c in conditions}

    def held(self, name: str) -> Held:
        condition = self._conditions[name]
        return held(self.head, condition.window_s, lambda s: bool(condition.test(s)))

    def falls(self, name: str) -> int:
        condition = self._conditions[name]
        drops = 0
        previous: bool | None = None
        for sample in self.head.since(condition.window_s):
            current = condition.test(sample)
            if current and previous is False:
                drops += 1
            previous = current
        return drops

    def growth(self, name: str) -> int:
        return growth(self.head, self._conditions[name].window_s, name)

    def events_since(self, window_s: float, kind: str) -> Sequence[GpuEvent]:
        return tuple(e for e in self.head.events_since(window_s) if e.kind == kind)

    def read_errors(self) -> ReadErrors:
        last_good = self.head.last.t if self.head.last is not None else float("-inf")
        errors = [e for e in self.head.errors if e.t > last_good]
        return ReadErrors(Counter(e.kind for e in errors), {e.kind: e.detail for e in errors})


def finding(
    history: History, rule: str, severity: Severity, action: Action, reason: str, *, drill: bool = False
) -> Finding:
    """A Finding on this history's GPU, dated `history.now`."""
    return Finding(
        rule=rule,
        severity=severity,
        reason=reason,
        action=action,
        t=history.now,
        index=history.static.index,
        uuid=history.static.uuid,
        drill=drill,
    )


def clock_text(sample: GpuSample | None, max_mhz: int | None) -> str:
    """'SM clock 600 of 1980 MHz' (or without the maximum when unknown); '' without a reading."""
    if sample is None or sample.sm_clock_mhz is None:
        return ""
    if max_mhz is None:
        return f"SM clock {sample.sm_clock_mhz} MHz"
    return f"SM clock {sample.sm_clock_mhz} of {max_mhz} MHz"
