"""Who reads the API, as the kernel says: so that other users' ranks are shown without what identifies them.

A rank's pid, uid, job id and role (spare, in place) are what an attack on it starts from (the pid
to be recycled, the job to impersonate), so the API shows them only to root, to the daemon's own
user and to the rank's own user. The caller is known on the control socket (SO_PEERCRED) and, for
a TCP connection from this host, from the kernel's socket table (`/proc/net/tcp`, `tcp6`: the uid
that owns the client's end). A caller from another host, or one the table does not show, sees
nobody's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuwatch.control.peer import PeerCred

PEER = "gpuwatch.peer"  # the scope extension that holds a control-socket connection's PeerCred (httpserver)
_LOOPBACK = ("127.", "::1", "::ffff:127.")


def viewer_uid(scope: Mapping[str, Any], proc: Path = Path("/proc")) -> int | None:
    """The calling process's uid: from the control socket, or for a loopback TCP client from the socket table."""
    cred = scope.get("extensions", {}).get(PEER)
    if isinstance(cred, PeerCred):
        return cred.uid
    client, server = scope.get("client"), scope.get("server")
    if not client or not server or not str(client[0]).startswith(_LOOPBACK):
        return None
    wanted = ((_normal(client[0]), int(client[1])), (_normal(server[0]), int(server[1])))
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and (_address(fields[1]), _address(fields[2])) == wanted:
                return int(fields[7])
    return None


def sees(viewer: int | None, owner: int | None) -> bool:
    """Whether `viewer` may see what identifies a rank of `owner` (None: unknown)."""
    return viewer is not None and (viewer in (0, os.geteuid()) or viewer == owner)


def _normal(host: str) -> str:
    return host.removeprefix("::ffff:")


def _address(text: str) -> tuple[str, int] | None:
    """`0100007F:1F90` (or its 32-hex-digit IPv6 form) as ("127.0.0.1", 8080)."""
    hexaddr, _, hexport = text.partition(":")
    try:
        raw = bytes.fromhex(hexaddr)
        port = int(hexport, 16)
    except ValueError:
        return None
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host order
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words), port
    if len(words) == 16:
        if words[:12] == b"\0" * 10 + b"\xff\xff":
            return socket.inet_ntop(socket.AF_INET, words[12:]), port
        return socket.inet_ntop(socket.AF_INET6, words), port
    return None
