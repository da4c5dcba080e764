"""A clock that moves only when told: simulated time for `gpuwatch check`, a trace's own time for replay,
and the bench's and the tests' ticks, which can then be an interval apart without waiting for it."""

from __future__ import annotations


class ManualClock:
    """Callable like time.time; returns `t`, which only `advance` (or setting `t`) changes."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
