"""The daemon with one part of its NVML work left out: backends for `gpuwatch run --backend MODULE:CLASS`.

The attribution runs the real daemon (every thread, scraped every second) with each of these, so the
job's slowdown beside it splits by thread: the sampling thread's NVML (no events), the event thread's
(events only), the read plan's effect (the plan before), and, with the sim backend, everything the
daemon does besides NVML (rules, Snapshot, status.json, serving scrapes, remediation).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gpuwatch.backends import nvml_plan
from gpuwatch.backends.nvml import NvmlBackend
from gpuwatch.config import Config
from gpuwatch.model import GpuError, GpuEvent, GpuSample


class NvmlBeforePlan(NvmlBackend):
    """NVML read as before the read plan: every group every sample (nvml_plan.BEFORE)."""

    def __init__(self, config: Config, nvml: Any = None) -> None:
        super().__init__(config, nvml, plan=nvml_plan.BEFORE)


class NvmlWithoutEvents(NvmlBackend):
    """The sampling thread's NVML only: the event thread sleeps instead of waiting in NVML."""

    def wait_events(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        time.sleep(max(0.0, timeout_s))
        return []


class NvmlEventsOnly(NvmlBackend):
    """The event thread's NVML only: each GPU is read once, and that sample is repeated with a new time."""

    def __init__(self, config: Config, nvml: Any = None) -> None:
        super().__init__(config, nvml)
        self._first: dict[int, GpuSample] = {}

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        if index not in self._first:
            self._first[index] = super().sample(index, now, slow=True)
        return dataclasses.replace(self._first[index], t=now)


def backend_name(cls: type[NvmlBackend]) -> str:
    """The `--backend` value that runs the daemon with `cls`."""
    return f"{cls.__module__}:{cls.__qualname__}"
