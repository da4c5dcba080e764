"""Who is at the other end of a Unix socket, as the kernel says, not as the other end says."""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Not in Python's socket module. Linux >= 4.13; 59 on the asm-generic architectures (x86, arm, riscv...).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
MAX_GROUPS = 256  # Python's getsockopt reads at most 1024 bytes; a peer in more groups counts by its primary gid


@dataclass(frozen=True)
class PeerCred:
    """The peer's pid, uid, gid and supplementary groups when it connected (a server: when it listened)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def in_group(self, gid: int) -> bool:
        return self.gid == gid or gid in self.groups


def of(sock: socket.socket) -> PeerCred:
    """The credentials of the process at the other end of the connected Unix socket `sock`.

    Raises:
        OSError: not a connected Unix socket, or not Linux.
    """
    if not sys.platform.startswith("linux"):
        raise OSError("peer credentials are read on Linux only")
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCred(pid, uid, gid, _groups(sock))


def _groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups; () where the kernel cannot say (older than 4.13, or over MAX_GROUPS)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_GROUPS)
    except OSError:
        return ()
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
