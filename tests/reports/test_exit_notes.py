"""Exit notes: the launcher that started a rank dates its death on the report socket; nobody else can.

A note is untrusted input: one from a process that is not the rank's parent, a malformed one, or one dated
in the future or far in the past changes nothing and is said in one line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.launcher.exit_dates import ExitDates
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.reports.board import ReportBoard
from gpuwatch.reports.exit_notes import NOTE_FUTURE_S, NOTE_PAST_S
from gpuwatch.trainer.contract import exit_note
from tests.reporting import FakeRank

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
NOW = 1_700_000_000.0


@pytest.fixture
def rank() -> Iterator[FakeRank]:
    """A rank this test process started: its parent is us, as a rank's is its launcher."""
    child = FakeRank()
    yield child
    child.kill()
    child.wait()


def _board(rank: FakeRank) -> ReportBoard:
    board = ReportBoard(ProcFs(), wall=lambda: NOW)
    assert board.admit(rank.pid, os.getuid()) is not None
    board.receive(rank.pid, json.dumps({"t": NOW, "pid": rank.pid, "job_id": "j"}).encode())
    assert board.admit(os.getpid(), os.getuid()) is not None  # the launcher's own connection
    return board


def test_the_ranks_parent_dates_its_exit(rank: FakeRank) -> None:
    board = _board(rank)
    assert board.exit_note(os.getpid(), exit_note(rank.pid, NOW - 0.25))
    report = board.report(rank.pid)
    assert report is not None and report.exit_t == NOW - 0.25


@pytest.mark.parametrize(
    ("note", "why"),
    [
        (exit_note(0, NOW), "pid must be a process id"),
        (b'{"rank_exit": {"pid": 1, "t": "soon"}}', "t must be a Unix time"),
        (b'{"rank_exit": {"pid": 1, "t": 1e999}}', "t must be a Unix time"),
        (b'{"rank_exit": {"pid": 1, "t": 1, "x": 2}}', 'must be {"rank_exit"'),
        (b'{"rank_exit": [', "not JSON"),
    ],
)
def test_a_malformed_note_is_one_line_and_changes_nothing(
    rank: FakeRank, note: bytes, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    board = _board(rank)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.reports"):
        assert board.exit_note(os.getpid(), note)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and why in lines[0] and f"exit note of pid {os.getpid()}" in lines[0], lines
    assert board.report(rank.pid).exit_t is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("t", "why"),
    [
        (NOW + NOTE_FUTURE_S + 0.5, "s in the future"),
        (NOW - NOTE_PAST_S - 1, "s ago, more than 60 s"),
    ],
)
def test_a_note_dated_in_the_future_or_far_past_is_refused_in_one_line(
    rank: FakeRank, t: float, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    board = _board(rank)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.reports"):
        board.exit_note(os.getpid(), exit_note(rank.pid, t))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and why in lines[0], lines
    assert board.report(rank.pid).exit_t is None  # type: ignore[union-attr]


def test_a_process_that_did_not_start_the_rank_cannot_date_its_death(
    rank: FakeRank, caplog: pytest.LogCaptureFixture
) -> None:
    board = _board(rank)
    other = FakeRank()  # the rank's sibling: same user, not its parent
    try:
        assert board.admit(other.pid, os.getuid()) is not None
        with caplog.at_level(logging.WARNING, logger="gpuwatch.reports"):
            board.exit_note(other.pid, exit_note(rank.pid, NOW))
            board.exit_note(os.getpid(), exit_note(other.pid + 1_000_000, NOW))  # no such rank
    finally:
        other.kill()
        other.wait()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("is no rank it started" in line for line in lines), lines
    assert board.report(rank.pid).exit_t is None  # type: ignore[union-attr]


def test_the_launchers_note_reaches_the_daemon_over_the_report_socket(tmp_path: Path, rank: FakeRank) -> None:
    runtime = RuntimeDir(tmp_path / "run")
    runtime.prepare()
    dates = ExitDates(str(runtime.path))
    try:
        assert rank.report(runtime.path, t=time.time(), job_id="j", step=3)
        killed = time.time()
        assert dates.exit_began(rank.pid, killed)
        deadline = time.monotonic() + 5
        while (report := runtime.read_report(rank.pid)) is None or report.exit_t is None:
            assert time.monotonic() < deadline, report
            time.sleep(0.01)
        assert report.exit_t == pytest.approx(killed, abs=1e-6)
    finally:
        dates.close()
        runtime.close()
