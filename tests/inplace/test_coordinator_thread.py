"""The hosting launcher's coordinator thread lives as long as the job: bad events are skipped with one
line each and change nothing, a real exit still forms the next generation, and a thread that ends
anyway stops the job with one line instead of leaving the survivors to wait for a generation.

A real Supervisor with real worker processes that only sleep (they never join by themselves: the test
writes their `join` events, as InPlaceJob would, into the launcher's own store).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from gpuwatch.inplace.coordinator import Coordinator  # noqa: E402
from gpuwatch.inplace.protocol import JOIN, append_event, latest_generation, read_generation  # noqa: E402
from gpuwatch.launcher.in_place import GpuView, InPlacePlan, InPlaceStopped, Supervisor  # noqa: E402

SLEEPER = ("-c", "import time; time.sleep(120)")


class Running:
    """A Supervisor.run() on a thread: what it said, and how it ended."""

    def __init__(self, tmp_path: Path) -> None:
        plan = InPlacePlan(job_id="coord", command=SLEEPER, runtime_dir=str(tmp_path), nproc=2, max_restarts=0)
        gpus = [GpuView(i, f"GPU-{i}", True, 0) for i in range(2)]
        self.said: list[str] = []
        self.ended: list[object] = []
        self.supervisor = Supervisor(plan, lambda: gpus, echo=self.said.append, python=sys.executable)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        until(lambda: len(self.supervisor.workers) == 2, "both workers started")

    def _run(self) -> None:
        try:
            self.ended.append(self.supervisor.run())
        except InPlaceStopped as exc:
            self.ended.append(exc)

    def stop(self) -> None:
        self.supervisor.stop()
        self.thread.join(timeout=60)


def until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Running]:
    running = Running(tmp_path)
    yield running
    running.stop()


def _first_generation(job: Running) -> None:
    store = job.supervisor.store
    for worker in job.supervisor.workers:
        append_event(store, JOIN, member=worker.member, node=0)
    until(lambda: latest_generation(store) == 1, "generation 1")


def test_bad_events_are_skipped_one_line_each_and_a_real_exit_still_forms_the_next_generation(job: Running) -> None:
    _first_generation(job)
    store = job.supervisor.store
    first, second = (w.member for w in job.supervisor.workers)
    bad = [
        '{"kind": "gone", "code": 0}',  # a finish of nobody: before, no generation ever came again
        f'{{"kind": "gone", "member": "{first}", "code": -9, "node": 1}}',  # another launcher's word
        '{"kind": "join", "member": "mallory", "node": 0}',
        '{"kind": "shutdown"}',
        "\x00\xff not JSON",  # before, this ended the coordinator thread for good
    ]
    for body in bad:
        index = store.add("events", 1) - 1
        store.set(f"event/{index}", body)
    until(lambda: sum("skipped a bad event" in line for line in job.said) == len(bad), "one line per bad event")
    time.sleep(0.5)
    assert latest_generation(store) == 1 and job.thread.is_alive()
    assert sum("skipped a bad event" in line for line in job.said) == len(bad), job.said  # once each

    dying = next(w for w in job.supervisor.workers if w.member == second)
    os.kill(dying.process.pid, signal.SIGKILL)
    until(lambda: latest_generation(store) == 2, "generation 2 after a real death")
    assert read_generation(store, 2).members == (first,)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end is the test
def test_a_coordinator_that_ends_anyway_stops_the_job_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ends(self: Coordinator, now: float) -> None:
        raise SystemExit("a bug in the coordinator")  # what `except Exception` does not catch

    monkeypatch.setattr(Coordinator, "next_generation", ends)
    running = Running(tmp_path)
    try:
        running.thread.join(timeout=20)
        assert not running.thread.is_alive(), "the launcher went on without its coordinator"
    finally:
        running.stop()
    (ended,) = running.ended
    assert isinstance(ended, InPlaceStopped) and ended.code == 3, ended
    assert str(ended) == "the job's coordinator ended: the job stops (its ranks would wait)"
    assert all(w.process.poll() is not None for w in running.supervisor.workers)
