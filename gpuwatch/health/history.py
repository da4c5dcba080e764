"""The window of readings a rule judges: one GPU's recent samples, events and errors."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic


@dataclass(frozen=True)
class History:
    """What a rule sees for one GPU at time `now`. Tuples are oldest first.

    `samples` holds every sample within the longest rule window (and at least the last one);
    `events` and `errors` likewise. `baseline` is the first sample the daemon ever took of this
    GPU, so counters (ECC, row remap) can be judged as "new since we started watching".
    """

    static: GpuStatic
    now: float
    samples: tuple[GpuSample, ...] = ()
    events: tuple[GpuEvent, ...] = ()
    errors: tuple[GpuError, ...] = ()
    baseline: GpuSample | None = None

    @property
    def last(self) -> GpuSample | None:
        return self.samples[-1] if self.samples else None

    def since(self, window_s: float) -> tuple[GpuSample, ...]:
        """Samples no older than `window_s` before `now`."""
        return self.samples[self.first_since(window_s) :]

    def first_since(self, window_s: float) -> int:
        """Index of the oldest sample no older than `window_s` before `now` (samples are oldest first)."""
        return bisect_left(self.samples, self.now - window_s, key=lambda s: s.t)

    def events_since(self, window_s: float) -> tuple[GpuEvent, ...]:
        start = self.now - window_s
        return tuple(e for e in self.events if e.t >= start)
