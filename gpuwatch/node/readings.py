"""What the monitor reads before it judges: every GPU's sample, the backend's events, the ranks' reports.

Reading is slow and may block (a GPU that hangs NVML, an event wait, a report socket), so it is kept
apart from judging: one GPU failing to read becomes that GPU's GpuError and never stops the others.

Locking: none. Everything here runs outside the monitor's lock, so a slow read never holds up a
reader of the Snapshot or the other thread (sampling, events).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from gpuwatch.backends.base import Backend
from gpuwatch.errors import GpuReadError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic, TrainerInfo
from gpuwatch.node.runtime import RuntimeDir

log = logging.getLogger("gpuwatch.monitor")


def sample_all(
    backend: Backend, statics: Mapping[int, GpuStatic], now: float, *, slow: bool
) -> tuple[list[GpuSample | GpuError], float]:
    """One reading of every GPU at `now` (a failed read is its GpuError), and how long they took in seconds."""
    readings: list[GpuSample | GpuError] = []
    started = time.perf_counter()
    for index, static in statics.items():
        try:
            readings.append(backend.sample(index, now, slow=slow))
        except GpuReadError as exc:
            readings.append(GpuError(now, index, static.uuid, exc.kind, exc.detail))
        except Exception as exc:  # a bug or odd failure on one GPU must not hide the others
            log.exception("GPU %d: sample failed", index)
            readings.append(GpuError(now, index, static.uuid, "unknown", f"{type(exc).__name__}: {exc}"))
    return readings, time.perf_counter() - started


def follow_events(
    backend: Backend,
    handle: Callable[[Iterable[GpuEvent | GpuError]], object],
    stop: threading.Event,
    timeout_s: float,
) -> None:
    """The event thread: wait in the backend's event call and hand each batch to `handle` until `stop`."""
    while not stop.is_set():
        try:
            readings = backend.wait_events(timeout_s)
        except Exception:  # a broken event path must not kill the thread that would see the next XID
            log.exception("event wait failed; retrying in 1 s")
            stop.wait(1.0)
            continue
        if readings:
            log.info("events: %s", ", ".join(_describe(r) for r in readings))
            handle(readings)


def fresh_trainers(runtime: RuntimeDir | None, now: float, stale_after_s: float) -> tuple[TrainerInfo, ...]:
    """The running ranks' reports, not older than `stale_after_s` (every report is untrusted)."""
    if runtime is None:
        return ()
    reports = runtime.read_reports()
    return tuple(r.info for r in reports if r.running and now - (r.info.updated_t or 0.0) <= stale_after_s)


def _describe(reading: GpuEvent | GpuError) -> str:
    if isinstance(reading, GpuEvent):
        return f"GPU {reading.index} {reading.kind}" + (f" {reading.xid}" if reading.xid is not None else "")
    return f"GPU {reading.index} error {reading.kind}"
