"""`gpuwatch record`: write a trace from any backend, samples on a fixed interval, events as they come."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gpuwatch.backends import open_backend
from gpuwatch.backends.trace import TraceWriter
from gpuwatch.config import Config
from gpuwatch.errors import GpuReadError, TraceError
from gpuwatch.model import GpuError, GpuSample, GpuStatic


def record(
    config: Config,
    out: Path,
    duration_s: float,
    interval_s: float,
    progress: Callable[[float, float], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> dict[str, int]:
    """Record `duration_s` of readings into `out`; returns counts of samples, events and errors.

    Raises:
        TraceError: `out` cannot be written (one line naming it; checked before the backend is opened).
    """
    _check_writable(out)
    backend, statics = open_backend(config)
    counts = {"samples": 0, "events": 0, "errors": 0}
    note = f"recorded by gpuwatch record with the {backend.name} backend every {interval_s:g} s"
    try:
        with _writer(out, statics, note) as writer:
            start = clock()
            next_tick = start
            while (now := clock()) - start < duration_s:
                for static in statics:
                    reading: GpuSample | GpuError
                    try:
                        reading = backend.sample(static.index, now, slow=True)
                        counts["samples"] += 1
                    except GpuReadError as exc:
                        reading = GpuError(now, static.index, static.uuid, exc.kind, exc.detail)
                        counts["errors"] += 1
                    writer.write(reading)
                if progress:
                    progress(now - start, duration_s)
                next_tick += interval_s
                # Events arrive while we wait for the next tick, so a recorded XID keeps its own time.
                while (remaining := min(next_tick, start + duration_s) - clock()) > 0:
                    for event in backend.wait_events(remaining):
                        writer.write(event)
                        counts["events" if not isinstance(event, GpuError) else "errors"] += 1
    except OSError as exc:  # a full disk, a file system gone read-only: one line, the trace so far is kept
        raise TraceError(f"--out {out}: cannot write: {exc.strerror or exc}") from None
    finally:
        backend.close()
    return counts


def _check_writable(out: Path) -> None:
    """The directory `out` goes in must be there (checked before the backend is opened)."""
    if not out.parent.is_dir():
        raise TraceError(f"--out {out}: no directory {out.parent}")


def _writer(out: Path, statics: tuple[GpuStatic, ...], note: str) -> TraceWriter:
    try:
        return TraceWriter(out, statics, note)
    except OSError as exc:
        raise TraceError(f"--out {out}: cannot write: {exc.strerror or exc}") from None
