"""The replay backend (`--backend replay`): a recorded trace played back on its own timestamps.

The daemon's clock plays no part: each GPU gets its next sample in file order, so a trace judged live
and judged by `gpuwatch replay FILE` (which uses iter_ticks, without any backend) gives the same findings.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from gpuwatch.backends.trace import Trace, read_trace
from gpuwatch.config import Config
from gpuwatch.errors import BackendError, GpuReadError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic, Reading

# When no event is due, wait_events waits this long so an event loop calling it does not spin.
_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class Tick:
    """One sampling round of a trace: its readings in time order, judged at `t` (the last one's time)."""

    t: float
    readings: tuple[Reading, ...]


def iter_ticks(trace: Trace) -> Iterator[Tick]:
    """The trace's readings in time order, grouped into sampling rounds.

    A round ends where a GPU that already has a sample or error in it reads again, so rounds recorded
    with one `now` for all GPUs, or with slightly staggered times, group the same way. Events join
    the round they fall in, so they are judged at once rather than at the next sample.
    """
    ordered = sorted(trace.readings, key=lambda r: r.t)
    group: list[Reading] = []
    read: set[int] = set()
    for reading in ordered:
        if not isinstance(reading, GpuEvent):
            if reading.index in read:
                yield Tick(group[-1].t, tuple(group))
                group, read = [], set()
            read.add(reading.index)
        group.append(reading)
    if group:
        yield Tick(group[-1].t, tuple(group))


class ReplayBackend:
    """Plays `config.replay_file` back; `exhausted` turns true once every reading has been handed out."""

    name = "replay"

    def __init__(self, config: Config) -> None:
        self._path = config.replay_file
        self._queues: dict[int, deque[GpuSample | GpuError]] = {}
        self._events: deque[GpuEvent] = deque()
        self._handed_t: float | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def open(self) -> tuple[GpuStatic, ...]:
        """Read the whole trace.

        Raises:
            BackendError: no replay file is configured.
            TraceError: the file is missing or malformed (one line naming file and line).
        """
        if not self._path:
            raise BackendError("replay: no trace file given (set replay_file or pass --replay-file)")
        trace = read_trace(self._path)
        self._queues = {s.index: deque() for s in trace.statics}
        for reading in trace.readings:
            if not isinstance(reading, GpuEvent):
                self._queues[reading.index].append(reading)
        self._events = deque(sorted((r for r in trace.readings if isinstance(r, GpuEvent)), key=lambda e: e.t))
        return trace.statics

    @property
    def exhausted(self) -> bool:
        """True when every sample, error and event of the trace has been handed out."""
        with self._lock:
            return not self._events and not any(self._queues.values())

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        """This GPU's next sample in file order, with the trace's own time (`now` is ignored).

        Raises:
            GpuReadError: the next line for this GPU is an error line (its kind).
            BackendError: this GPU has no readings left, or is not in the trace.
        """
        with self._lock:
            queue = self._queues.get(index)
            if not queue:
                raise BackendError(f"replay: {self._path} has no more readings for GPU {index}")
            reading = queue.popleft()
            self._handed_t = reading.t if self._handed_t is None else max(self._handed_t, reading.t)
        if isinstance(reading, GpuError):
            raise GpuReadError(reading.kind, f"recorded at t={reading.t}")
        return reading

    def wait_events(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        """Events up to the latest reading handed out (all that remain once the samples run out)."""
        with self._lock:
            done = not any(self._queues.values())
            due: list[GpuEvent | GpuError] = []
            while self._events and (done or (self._handed_t is not None and self._events[0].t <= self._handed_t)):
                due.append(self._events.popleft())
        if not due:
            self._wake.wait(min(timeout_s, _IDLE_WAIT_S))
        return due

    def close(self) -> None:
        self._wake.set()
