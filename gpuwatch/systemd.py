"""sd_notify over the service manager's datagram socket, in pure Python (no libsystemd).

systemd's notify protocol (sd_notify(3)): newline-separated assignments such as `READY=1`,
sent as one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or an abstract
name written with a leading '@'). Every call is a no-op returning False outside systemd, so
the daemon calls these unconditionally.

config.py is the only reader of gpuwatch's settings from the environment. NOTIFY_SOCKET is the
documented exception: the service manager sets it for each start of the unit, it is not a
gpuwatch setting, and it must be read at the moment of use, so it is read here.
"""

from __future__ import annotations

import os
import socket


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
