"""Drills on a live node: each GPU's injection laid over its readings, and how long its findings count as a drill.

An injection overrides fields of one GPU's readings for a while (or injects an event); whatever the rules
find on that GPU meanwhile, and while their windows still hold what it caused, is marked as a drill.
What may be injected is checked in node.injection before it gets here.

Locking: none of its own. Only the monitor calls it, under the monitor's lock, except `new`, which
changes nothing the others read.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Mapping
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic
from gpuwatch.node.injection import Injection, checked_injection

log = logging.getLogger("gpuwatch.monitor")


class DrillOverlay:
    """The injections in force (one per GPU) and, per GPU, until when its findings are a drill's."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s  # how long the rules' windows hold a reading: a drill's marks last that much longer
        self.injections: dict[int, Injection] = {}
        self._drill_until: dict[int, float] = {}
        self._ids = itertools.count(1)

    def new(
        self,
        static: GpuStatic,
        fields: Mapping[str, Any],
        duration_s: float,
        now: float,
        event: str | None = None,
        xid: int | None = None,
    ) -> Injection:
        """A checked injection on GPU `static` from `now`, not yet in force (`put` it).

        Raises:
            ConfigError: a field that may not be injected, or a duration outside (0, 86400] seconds.
        """
        fields = checked_injection(fields)
        if not (math.isfinite(duration_s) and 0 < duration_s <= 86400):
            raise ConfigError(f"inject: duration_s: {duration_s!r} is not within (0, 86400] seconds")
        injected_event = GpuEvent(now, static.index, static.uuid, event, xid, drill=True) if event else None
        return Injection(next(self._ids), static.index, dict(fields), now, now + duration_s, injected_event)

    def put(self, injection: Injection) -> None:
        """Put `injection` in force (replacing its GPU's), and mark its GPU's findings as a drill's."""
        if injection.fields:
            self.injections[injection.index] = injection
        until = injection.until + self.keep_s
        self._drill_until[injection.index] = max(self._drill_until.get(injection.index, 0.0), until)

    def in_force(self, now: float) -> list[Injection]:
        return [i for i in self.injections.values() if i.until > now]

    def end(self, injection_id: int, now: float) -> Injection | None:
        """End the injection in force by that id now, or None; its marks last while the windows hold it."""
        injection = next((i for i in self.injections.values() if i.id == injection_id and i.until > now), None)
        if injection is None:
            return None
        del self.injections[injection.index]
        self._drill_until[injection.index] = min(self._drill_until.get(injection.index, 0.0), now + self.keep_s)
        return injection

    def drilling(self, index: int, now: float) -> bool:
        """Whether what the rules find on GPU `index` at `now` is a drill's."""
        return self._drill_until.get(index, 0.0) > now

    def overlay(self, reading: GpuSample | GpuError, now: float) -> GpuSample | GpuError:
        """`reading` as the injection in force on its GPU makes it (an injection past its end is dropped)."""
        injection = self.injections.get(reading.index)
        if injection is None:
            return reading
        if injection.until <= now:
            del self.injections[reading.index]
            log.warning("drill: injection %d on GPU %d ended", injection.id, reading.index)
            return reading
        if isinstance(reading, GpuError):
            return reading
        if injection.fields.get("error"):
            return GpuError(reading.t, reading.index, reading.uuid, str(injection.fields["error"]), "injected")
        return dataclasses.replace(reading, **{k: v for k, v in injection.fields.items() if k != "error"})
