"""The client's side of the control socket: connect to the daemon, and to nothing that only looks like it.

A local user can bind the TCP port while the daemon is down and answer like it; over TCP nothing
tells them apart. The control socket does: the path is checked (socket_path.check) and, once
connected, the kernel says who listens on it (SO_PEERCRED). Only root (systemd's socket unit, or
the daemon itself) or the caller's own user is believed, so the answers a client acts on are the
daemon's and nothing secret is ever sent elsewhere.
"""

from __future__ import annotations

import http.client
import socket
from pathlib import Path

from gpuwatch.base.unixsock import address as unix_address
from gpuwatch.control import peer, socket_path
from gpuwatch.control.peer import PeerCred
from gpuwatch.control.socket_path import NoControlSocket, NotTheDaemon


def connect(path: Path, timeout_s: float) -> tuple[socket.socket, PeerCred]:
    """A connected socket to the daemon at `path`, and the credentials of the process that listens on it.

    Raises:
        NoControlSocket: nothing there, or nothing answers.
        NotTheDaemon: the socket, its directory or the process listening on it is not root's (nor the caller's).
    """
    socket_path.check(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        with unix_address(path) as address:
            sock.connect(address)
        server = peer.of(sock)
    except OSError as exc:
        sock.close()
        raise NoControlSocket(f"nothing answers at {path}: {exc.strerror or exc}") from None
    if server.uid not in socket_path.trusted_uids():
        sock.close()
        raise NotTheDaemon(f"{path} is served by uid {server.uid} (pid {server.pid}), not root: refusing it")
    return sock, server


class ControlConnection(http.client.HTTPConnection):
    """http.client over the control socket; `server` holds who answers, once connected."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self.path = path
        self.timeout_s = timeout_s
        self.server: PeerCred | None = None

    def connect(self) -> None:
        self.sock, self.server = connect(self.path, self.timeout_s)
