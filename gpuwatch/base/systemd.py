"""The service manager's two protocols, in pure Python (no libsystemd): sd_notify and sd_listen_fds.

systemd's notify protocol (sd_notify(3)): newline-separated assignments such as `READY=1`,
sent as one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or an abstract
name written with a leading '@'). Every call is a no-op returning False outside systemd, so
the daemon calls these unconditionally.

Socket activation (sd_listen_fds(3)): a socket unit (systemd/gpuwatch.socket) creates and listens
on the sockets and hands them to the service as file descriptors 3, 4, ...: $LISTEN_PID is the
pid they are meant for, $LISTEN_FDS how many, $LISTEN_FDNAMES their names. The sockets outlive
the daemon, so its port and control socket are never free for another process to take between
two runs (a restart, an upgrade, a crash).

config.py is the only reader of gpuwatch's settings from the environment. NOTIFY_SOCKET and
LISTEN_* are the documented exceptions: the service manager sets them for each start of the
unit, they are not gpuwatch settings, and they are read here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

LISTEN_FDS_START = 3


def notify(message: str) -> bool:
    """Send `message` to the service manager; False if not under systemd or the send failed.

    The socket is non-blocking: a notification is never worth stalling the sampling loop,
    and a manager too busy to take a watchdog ping will restart us anyway.
    """
    path = os.environ.get("NOTIFY_SOCKET", "")
    if path.startswith("@"):
        address = "\0" + path[1:]
    elif path.startswith("/"):
        address = path
    else:  # unset, or a transport this module does not speak (systemd 254+ "vsock:...")
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(message.encode(), address)
        except OSError:
            return False
    return True


def ready() -> bool:
    """Tell systemd start-up is done (Type=notify units stay 'activating' until this)."""
    return notify("READY=1")


def watchdog() -> bool:
    """Keep-alive ping; without one every WatchdogSec= systemd kills and restarts the daemon."""
    return notify("WATCHDOG=1")


def stopping() -> bool:
    """Tell systemd a clean shutdown has begun, so a slow stop is not taken for a hang."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """Set the one-line status `systemctl status gpuwatch` shows (a newline would end the assignment)."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def listen_fds(environ: MutableMapping[str, str] | None = None) -> list[socket.socket]:
    """The sockets the service manager passed to this process (none outside socket activation).

    Variables meant for another pid (a child that inherited them) are ignored. The variables are
    removed, so the daemon's own children (drills, the GPU test) never take the sockets for theirs,
    and the descriptors are made close-on-exec for the same reason.
    """
    env = os.environ if environ is None else environ
    pid, count = env.get("LISTEN_PID", ""), env.get("LISTEN_FDS", "")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(name, None)
    if not (pid.isdigit() and int(pid) == os.getpid() and count.isdigit()):
        return []
    sockets = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets
