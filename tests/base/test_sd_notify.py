"""gpuwatch.base.systemd speaks sd_notify: datagrams arrive on a real socket, path or abstract."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.base import systemd


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket standing in for systemd, named by NOTIFY_SOCKET."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


@pytest.fixture
def abstract_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """Like notify_socket, in the abstract namespace (how systemd names it in some setups)."""
    name = f"gpuwatch-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield sock


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (systemd.ready, b"READY=1"),
        (systemd.watchdog, b"WATCHDOG=1"),
        (systemd.stopping, b"STOPPING=1"),
    ],
)
def test_state_messages_arrive(notify_socket: socket.socket, send: Callable[[], bool], expected: bytes) -> None:
    assert send() is True
    assert notify_socket.recv(4096) == expected


def test_status_arrives_on_one_line(notify_socket: socket.socket) -> None:
    assert systemd.status("sampling 8 GPUs\n1 quarantined") is True
    assert notify_socket.recv(4096) == b"STATUS=sampling 8 GPUs 1 quarantined"


def test_messages_arrive_in_order(notify_socket: socket.socket) -> None:
    systemd.status("starting")
    systemd.ready()
    systemd.watchdog()
    systemd.stopping()
    got = [notify_socket.recv(4096) for _ in range(4)]
    assert got == [b"STATUS=starting", b"READY=1", b"WATCHDOG=1", b"STOPPING=1"]


def test_abstract_socket(abstract_socket: socket.socket) -> None:
    assert systemd.ready() is True
    assert abstract_socket.recv(4096) == b"READY=1"


def test_no_socket_is_a_quiet_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.ready() is False
    assert systemd.notify("WATCHDOG=1") is False


@pytest.mark.parametrize("value", ["", "relative/notify.sock", "vsock:2:1234"])
def test_unsupported_addresses_are_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.watchdog() is False


def test_missing_socket_file_returns_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert systemd.watchdog() is False
