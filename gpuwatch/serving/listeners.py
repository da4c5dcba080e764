"""The daemon's two listening sockets: the TCP listener (metrics, status, read-only API) and the control socket.

Under systemd both come from gpuwatch.socket (systemd.listen_fds): bound before the daemon starts and
kept bound between its runs, so no other process can take the port, or put a socket at the control
path, while the daemon restarts, upgrades or crashes. They must be what the config says: a socket
unit that listens elsewhere is one line, exit 2, not a daemon serving an address nobody expects.

Without systemd the daemon binds both itself, and removes the control socket when it stops.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.base import systemd
from gpuwatch.base.unixsock import address
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError

log = logging.getLogger("gpuwatch.daemon")

CONTROL_SOCKET_MODE = 0o666  # anyone may connect and read; who may change state is decided per connection


@dataclass
class Listeners:
    tcp: socket.socket
    control: socket.socket
    control_path: Path
    activated: bool  # from the service manager: its sockets, never removed here
    bound_inode: int = 0  # the control socket this daemon bound (not activated)

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.tcp, self.control]

    def close(self) -> None:
        """Remove the control socket this daemon bound (if it is still the one it bound)."""
        if self.activated:
            return
        try:
            if os.lstat(self.control_path).st_ino == self.bound_inode:
                self.control_path.unlink()
        except OSError:
            pass


def open_listeners(config: Config) -> Listeners:
    """The sockets gpuwatch.socket passed, else both bound here.

    Raises:
        ConfigError: one line: the address is busy or cannot be bound, or the socket unit disagrees with the config.
    """
    passed = systemd.listen_fds()
    if passed:
        return _from_socket_unit(config, passed)
    tcp = bind_tcp(config)
    try:
        control = bind_control(config.control_socket)
    except ConfigError:
        tcp.close()
        raise
    return Listeners(tcp, control, config.control_socket, False, os.lstat(config.control_socket).st_ino)


def bind_tcp(config: Config) -> socket.socket:
    """Bind the listen address ourselves so a busy port is one clear line, not a uvicorn traceback."""
    # A host name (localhost, the node's name) binds to the first address it resolves to, v4 or v6.
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without
    # it every keep-alive scrape after the first waits ~40 ms for a delayed ACK.
    family, address_ = _resolve(config)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address_)
    except OSError as exc:
        sock.close()
        hint = " (under systemd, gpuwatch.socket holds the port between runs)" if exc.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"listen {config.listen}: {exc.strerror or exc}{hint}") from None
    return sock


def bind_control(path: Path) -> socket.socket:
    """Bind the control socket at `path`, replacing a stale one (nothing listening) and nothing else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise ConfigError(f"api.socket {path}: {exc.strerror or exc}") from None
    if info is not None:
        if not stat.S_ISSOCK(info.st_mode):
            raise ConfigError(f"api.socket {path}: exists and is not a socket; remove it")
        if _answers(path):
            raise ConfigError(f"api.socket {path}: another process serves it")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with address(path) as where:
            sock.bind(where)
        os.chmod(path, CONTROL_SOCKET_MODE)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"api.socket {path}: cannot bind it: {exc.strerror or exc}") from None
    return sock


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with address(path) as where:
            probe.connect(where)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _resolve(config: Config) -> tuple[socket.AddressFamily, tuple[str, int]]:
    host, port = config.listen_host.strip("[]"), config.listen_port
    try:
        family, _, _, _, found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    except (socket.gaierror, IndexError) as exc:
        raise ConfigError(f"listen {config.listen}: cannot resolve {host!r}: {getattr(exc, 'strerror', exc)}") from None
    return family, (str(found[0]), int(found[1]))


def _from_socket_unit(config: Config, passed: list[socket.socket]) -> Listeners:
    tcp = [s for s in passed if s.family in (socket.AF_INET, socket.AF_INET6)]
    unix = [s for s in passed if s.family == socket.AF_UNIX]
    if len(tcp) != 1 or len(unix) != 1 or len(passed) != 2:
        raise ConfigError(
            f"gpuwatch.socket passed {len(tcp)} TCP and {len(unix)} Unix socket(s) of {len(passed)}: "
            "it must listen on the config's `listen` and on its control socket (api.socket), once each"
        )
    _, wanted = _resolve(config)
    got = tcp[0].getsockname()
    if (ipaddress.ip_address(got[0]), got[1]) != (ipaddress.ip_address(wanted[0]), wanted[1]):
        raise ConfigError(
            f"listen {config.listen}: gpuwatch.socket listens on {got[0]}:{got[1]} instead; "
            "make its ListenStream= and `listen` the same"
        )
    path = unix[0].getsockname()
    if path != str(config.control_socket):
        raise ConfigError(
            f"api.socket {config.control_socket}: gpuwatch.socket listens on {path!r} instead; "
            "make its ListenStream= and api.socket (or state_dir) the same"
        )
    log.info("listening on the sockets gpuwatch.socket holds: %s and %s", config.listen, path)
    return Listeners(tcp[0], unix[0], config.control_socket, activated=True)
