"""Who made the other end of a TCP connection, where the kernel can tell: both ends on this node.

A TCP socket has no SO_PEERCRED, but the kernel knows the owner (uid) of every socket on the node
and tells it through sock_diag (NETLINK_SOCK_DIAG, what `ss -e` reads): one exact lookup by the
connection's four-tuple, no scan of /proc/net/tcp. The job's store closes a connection made by
another user of its node before it says a word, and a client does not talk to a store that another
user listens with. A peer on another node (or a kernel without sock_diag, e.g. a sandbox) is told
apart by nothing here: None, and the secret's proofs decide as before.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NOCOOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2 up to its socket id
_UID_AT = _HEADER.size + 4 + 48 + 12  # inet_diag_msg: family..retrans, id, expires, rqueue, wqueue, then uid


def socket_owner(sock: socket.socket) -> int | None:
    """The uid that owns the other end of `sock` when it is on this node; None when that cannot be told."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    if not _same_node(local[0], peer[0]):
        return None
    family = sock.family
    with contextlib.suppress(OSError, ValueError, struct.error):
        return _lookup(family, (peer[0], peer[1]), (local[0], local[1]))
    return None


def _same_node(local: str, peer: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(peer).is_loopback or local == peer
    return False


def _lookup(family: int, source: tuple[str, int], destination: tuple[str, int]) -> int | None:
    """The uid of the TCP socket whose own address is `source` and whose peer is `destination`."""

    def packed(address: str) -> bytes:
        raw = socket.inet_pton(family, address)
        return raw + bytes(16 - len(raw))

    sockid = (
        struct.pack("!HH", source[1], destination[1])
        + packed(source[0])
        + packed(destination[0])
        + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE)
    )
    request = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    message = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as netlink:
        netlink.settimeout(1.0)
        netlink.sendto(message, (0, 0))
        answer = netlink.recv(8192)
    _, kind, _, _, _ = _HEADER.unpack_from(answer)
    if kind != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket (it closed meanwhile) or no sock_diag here
    (uid,) = struct.unpack_from("=I", answer, _UID_AT)
    return int(uid)
