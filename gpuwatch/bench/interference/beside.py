"""What runs beside the job in a condition: a monitor process, frozen between its segments, or a loop of the bench's.

A monitor is started once, before the first segment, and frozen (SIGSTOP) as soon as it answers; for
each of its segments it is thawed (SIGCONT) and scraped every `scrape_s` as Prometheus would scrape
it, then frozen again. A frozen process makes no call and uses no CPU, so the alone segments between
are the job alone, and a round costs no start-up; the bench also times the job before any monitor is
started and after all have stopped ("bare") to show whether their frozen presence (open NVML handles,
a registered event set) costs anything; where it does, `restart` starts and stops each monitor around
its segments instead. After a thaw, `settle_s` passes before the job is timed: gpuwatch's sampling
thread makes up the round it missed while frozen at once, then keeps its phase, so the timed part
sees its steady rate.
"""

from __future__ import annotations

import http.client
import os
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from gpuwatch.bench.daemon_process import ServerProcess
from gpuwatch.bench.harness import Http
from gpuwatch.bench.interference.caller import CallerProcess

THAW_SETTLE_S = 1.0


class Beside(Protocol):
    """One condition: `open` before the run, `resume` and `pause` around each of its segments, `close` after."""

    key: str
    label: str
    settle_s: float

    def open(self) -> None: ...

    def resume(self) -> None: ...

    def pause(self) -> None: ...

    def close(self) -> dict[str, Any]: ...


class _Scraper:
    """GET /metrics every `every_s` while active; `pause` returns once no scrape is in flight."""

    def __init__(self, port: int, every_s: float) -> None:
        self.every_s = every_s
        self.scrapes = self.errors = 0
        self._http = Http(port)
        self._active = threading.Event()
        self._closed = False
        self._in_flight = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"scrape-{port}", daemon=True)
        self._thread.start()

    def resume(self) -> None:
        self._active.set()

    def pause(self) -> None:
        self._active.clear()
        with self._in_flight:
            pass

    def close(self) -> None:
        self._closed = True
        self._active.set()
        self._thread.join(timeout=15)
        self._http.close()

    def _run(self) -> None:
        while True:
            self._active.wait()
            if self._closed:
                return
            started = time.monotonic()
            with self._in_flight:
                if not self._active.is_set():
                    continue
                try:
                    status, _ = self._http.request("GET", "/metrics")
                    self.scrapes += status == 200
                    self.errors += status != 200
                except (OSError, http.client.HTTPException):
                    self.errors += 1
            time.sleep(max(0.0, started + self.every_s - time.monotonic()))


class Monitor:
    """A monitor process (a gpuwatch daemon, nvitop-exporter), scraped during its segments only.

    Frozen between its segments; with `restart`, started for each segment and stopped after it
    instead (no process at all in the alone segments, at the price of a start-up per segment, and a
    30 s daemon's ticks are then not seen in segments shorter than its interval).
    """

    def __init__(
        self,
        key: str,
        label: str,
        server: ServerProcess,
        scrape_s: float,
        settle_s: float = THAW_SETTLE_S,
        restart: bool = False,
    ) -> None:
        self.key, self.label = key, label
        self.settle_s = settle_s
        self.server = server
        self.scrape_s = scrape_s
        self.restart = restart
        self.starts = 0
        self._scraper: _Scraper | None = None

    def open(self) -> None:
        if not self.restart:
            self._start()
            os.kill(self.server.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.restart:
            self._start()
        else:
            os.kill(self.server.pid, signal.SIGCONT)
        assert self._scraper is not None
        self._scraper.resume()

    def pause(self) -> None:
        assert self._scraper is not None
        self._scraper.pause()
        if self.restart:
            self.server.stop()
        else:
            os.kill(self.server.pid, signal.SIGSTOP)

    def close(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"starts": self.starts}
        if self._scraper is not None:
            self._scraper.close()
            figures.update(scrapes=self._scraper.scrapes, scrape_errors=self._scraper.errors)
        if self.starts and self.server.process.poll() is None:
            os.kill(self.server.pid, signal.SIGCONT)  # a stopped process would hold SIGTERM until thawed
        figures["exit_code"] = self.server.stop()
        return figures

    def _start(self) -> None:
        self.server.start()
        self.starts += 1
        if self._scraper is None:
            self._scraper = _Scraper(self.server.port, self.scrape_s)


class CommandLoop:
    """A command run every `every_s` on a steady phase during the segments (`nvidia-smi --query-gpu=…`)."""

    def __init__(self, key: str, label: str, argv: Sequence[str], every_s: float) -> None:
        self.key, self.label = key, label
        self.settle_s = 0.0
        self.argv = list(argv)
        self.every_s = every_s
        self.durations: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        """Nothing runs between segments."""

    def resume(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="command-loop", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> dict[str, Any]:
        median = statistics.median(self.durations) * 1e3 if self.durations else None
        return {"calls": len(self.durations), "failures": self.failures, "call_p50_ms": median}

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            started = time.monotonic()
            done = subprocess.run(self.argv, capture_output=True, timeout=30, check=False)
            self.durations.append(time.monotonic() - started)
            self.failures += done.returncode != 0
            due += self.every_s
            self._stop.wait(max(0.0, due - time.monotonic()))


class CallLoop:
    """One kind of NVML call in the helper process at `rate` a second during the segment (the attribution).

    A kind that probed well but fails to start is recorded in `failed` and its segment is timed as an
    idle one; the attribution leaves it out rather than lose the run.
    """

    def __init__(self, caller: CallerProcess, kind: str, label: str, rate: float) -> None:
        self.key, self.label = f"call:{kind}", label
        self.settle_s = 0.0
        self.kind = kind
        self.caller = caller
        self.rate = rate
        self.calls = self.errors = 0
        self.seconds = 0.0
        self.failed = ""
        self._running = False

    def open(self) -> None:
        """The helper is one process for every kind, opened by the attribution."""

    def resume(self) -> None:
        try:
            self.caller.run(self.kind, self.rate)
        except RuntimeError as exc:
            self.failed = str(exc)
            return
        self._running = True

    def pause(self) -> None:
        if not self._running:
            return
        self._running = False
        calls, seconds, errors = self.caller.stop()
        self.calls += calls
        self.seconds += seconds
        self.errors += errors

    def close(self) -> dict[str, Any]:
        per_s = self.calls / self.seconds if self.seconds else None
        return {"calls": self.calls, "calls_per_s": per_s, "errors": self.errors}
