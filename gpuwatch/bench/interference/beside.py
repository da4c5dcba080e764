"""What runs beside the job in a condition: a monitor process, started around its segments, or a loop of the bench's.

By default a monitor is started for each of its segments and killed after it (`restart`): the alone
segments between have no monitor process at all. SIGKILL, not SIGTERM: nothing of a monitor's
shutdown lands in the next alone segment, and the next round comes sooner. It is started once
before the rounds as well, to know it starts and how long that takes (the rounds are planned with
it). While running it is scraped every `scrape_s` as Prometheus would scrape it, and after each
start `settle_s` passes before the job is timed (its first sample and event registration are done).

Frozen instead (`restart` False, the first H200 run's method): started once and frozen (SIGSTOP) as
soon as it answers, thawed (SIGCONT) for its own segments. A round then costs no start-up, but a
frozen process still holds what it opened (NVML handles, a registered event set), which the alone
segments then share; on an H200 the alone segments read 0.48 % slower than the bare ones that way.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpuwatch.bench.harness import Http
from gpuwatch.bench.interference.caller import CallerProcess
from gpuwatch.testing.daemon_process import ServerProcess

THAW_SETTLE_S = 1.0  # after a thaw: gpuwatch's sampling thread makes up the round it missed while frozen first
START_SETTLE_S = 0.5  # after a start: the first sample is made before it answers, the event set registered after

Facts = Callable[[ServerProcess], dict[str, Any]]


class Beside(Protocol):
    """One condition: `open` before the run, `resume` and `pause` around each of its segments, `close` after.

    `start_s` is what a resume costs before `settle_s` (a start in restart mode), for planning rounds.
    """

    key: str
    label: str
    settle_s: float
    start_s: float

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

    Started around each of its segments (`restart`), or frozen between them. `facts`, asked once
    while it runs, says what it found at start (gpuwatch: whether it reads the kernel log). In
    restart mode the exit code is the kill's; `died_in_segments` counts the times it had ended
    before its segment did.
    """

    def __init__(
        self,
        key: str,
        label: str,
        server: ServerProcess,
        scrape_s: float,
        settle_s: float = START_SETTLE_S,
        restart: bool = True,
        facts: Facts | None = None,
    ) -> None:
        self.key, self.label = key, label
        self.settle_s = settle_s
        self.server = server
        self.scrape_s = scrape_s
        self.restart = restart
        self.facts = facts
        self.found: dict[str, Any] = {}
        self.starts = self.died = self.start_failures = 0
        self.start_s = 0.0
        self._start_times: list[float] = []
        self._scraper: _Scraper | None = None

    def open(self) -> None:
        """Start it once: RuntimeError when it does not start; then stopped (restart) or frozen until its turn."""
        self._start()
        if self.facts is not None:
            self.found = self.facts(self.server)
        if self.restart:
            self.server.kill()
            self.start_s = self._start_times[0]
        else:
            os.kill(self.server.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Raises RuntimeError when a restart fails (counted): that segment is left out."""
        if self.restart:
            try:
                self._start()
            except RuntimeError:
                self.start_failures += 1
                raise
        else:
            os.kill(self.server.pid, signal.SIGCONT)
        assert self._scraper is not None
        self._scraper.resume()

    def pause(self) -> None:
        assert self._scraper is not None
        self._scraper.pause()
        if self.restart:
            self.died += self.server.process.poll() is not None  # it ended before its segment did
            self.server.kill()
        else:
            os.kill(self.server.pid, signal.SIGSTOP)

    def close(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"starts": self.starts, "start_failures": self.start_failures, **self.found}
        figures["died_in_segments"] = self.died
        if self._start_times:
            figures["start_s_p50"] = statistics.median(self._start_times)
        if self._scraper is not None:
            self._scraper.close()
            figures.update(scrapes=self._scraper.scrapes, scrape_errors=self._scraper.errors)
        if self.starts and self.server.process.poll() is None:
            os.kill(self.server.pid, signal.SIGCONT)  # a stopped process would hold SIGTERM until thawed
        figures["exit_code"] = self.server.stop()
        return figures

    def _start(self) -> None:
        started = time.monotonic()
        self.server.start()
        self._start_times.append(time.monotonic() - started)
        self.starts += 1
        if self._scraper is None:
            self._scraper = _Scraper(self.server.port, self.scrape_s)


def kernel_log_facts(server: ServerProcess, wait_s: float = 3.0) -> dict[str, Any]:
    """Whether a gpuwatch daemon reads the kernel log (under nvml.events = auto it then has no NVML event set).

    The gauge is in the Snapshot after the daemon's second sample (the kernel log is opened after the
    first), so this asks for up to `wait_s`; None when it never shows (a sim daemon has no kernel log).
    """
    client = Http(server.port)
    deadline = time.monotonic() + wait_s
    found = None
    try:
        while True:
            status, body = client.request("GET", "/metrics")
            found = re.search(rb"^gpuwatch_kernel_log_readable (\S+)$", body, re.MULTILINE) if status == 200 else None
            if found is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    except (OSError, http.client.HTTPException):
        pass  # not known: the run goes on without the fact
    finally:
        client.close()
    return {"kernel_log_readable": None if found is None else float(found.group(1)) == 1.0}


class CommandLoop:
    """A command run every `every_s` on a steady phase during the segments (`nvidia-smi --query-gpu=…`)."""

    def __init__(self, key: str, label: str, argv: Sequence[str], every_s: float) -> None:
        self.key, self.label = key, label
        self.settle_s = self.start_s = 0.0
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
    """One kind of NVML call in the helper process at `rate` a second during the segment (the attribution),
    or what it holds without calls (the event-set probe), `settle_s` after it began.

    A kind that probed well but fails to start is recorded in `failed` and its segment is timed as an
    idle one; the attribution leaves it out rather than lose the run.
    """

    def __init__(self, caller: CallerProcess, kind: str, label: str, rate: float, settle_s: float = 0.0) -> None:
        self.key, self.label = f"call:{kind}", label
        self.settle_s, self.start_s = settle_s, 0.0
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
