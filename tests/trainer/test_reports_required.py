"""Under `gpuwatch launch` (GPUWATCH_REPORTS_REQUIRED), a rank that cannot reach the report socket does not start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpuwatch.trainer import TrainerLink
from gpuwatch.trainer.channel import ReportsUnreachable
from gpuwatch.trainer.contract import REPORT_SOCKET, REPORTS_REQUIRED_ENV


def test_under_launch_no_report_socket_is_an_error_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPORTS_REQUIRED_ENV, "1")

    with pytest.raises(ReportsUnreachable) as raised:
        TrainerLink(tmp_path, stop_signal=None)

    assert str(raised.value).startswith(
        f"gpuwatch trainer: {REPORTS_REQUIRED_ENV} is set (gpuwatch launch) and reports cannot reach "
        f"{tmp_path / REPORT_SOCKET}: No such file or directory"
    )


def test_under_launch_a_listening_report_socket_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPORTS_REQUIRED_ENV, "1")
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    daemon.bind(str(tmp_path / REPORT_SOCKET))
    daemon.listen()

    with TrainerLink(tmp_path, stop_signal=None) as link:
        link.step(1)
    daemon.close()


def test_without_launch_no_report_socket_is_only_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPORTS_REQUIRED_ENV, raising=False)

    with TrainerLink(tmp_path, stop_signal=None) as link:
        link.step(1)
