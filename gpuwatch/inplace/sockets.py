"""gloo's missing abort, worked around: shut down a process group's own TCP connections.

torch 2.13's ProcessGroupGloo cannot be aborted, and its connections close only when the last
reference to the group goes (DDP's hooks on the module's parameters keep one for the module's
life). A rank whose collective failed must still free the peers that wait to receive from it (it is
alive, so gloo sees no error there), so it shuts those connections down itself: the peers get
"connection closed" at once. The generation's sockets are told from the others by taking the
process's socket descriptors before its group is formed and after its state source is synced (a
device mesh's subgroups are formed there, and a survivor may wait on one of those); a descriptor
number reused since is left alone (its inode differs), and so are listening sockets (gloo's listener
thread ends the process when its accept() fails) and anything but TCP (a unix socket to the daemon
made meanwhile). Linux only (/proc/self/fd); elsewhere nothing is found and nothing is done.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat


def socket_inodes() -> dict[int, int]:
    """This process's socket file descriptors and their inodes (Linux /proc; empty elsewhere)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            st = os.stat(f"/proc/self/fd/{name}")
            if stat.S_ISSOCK(st.st_mode):
                found[int(name)] = st.st_ino
    return found


def shut_down(sockets: dict[int, int]) -> None:
    """Shut down the group's connections (only those still the same sockets: a reused number is left alone)."""
    now = socket_inodes()
    for fd, inode in sockets.items():
        if now.get(fd) != inode:
            continue
        with contextlib.suppress(OSError):
            dup = socket.socket(fileno=os.dup(fd))
            try:
                tcp = dup.family in (socket.AF_INET, socket.AF_INET6) and dup.type == socket.SOCK_STREAM
                if tcp and not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    dup.getpeername()  # raises for a socket that is not connected
                    dup.shutdown(socket.SHUT_RDWR)  # acts on the socket itself: gloo's own descriptor sees it
            finally:
                dup.close()
