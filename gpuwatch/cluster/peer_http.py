"""Asking a peer server (Prometheus) without trusting it: one deadline for the whole request, a bounded
body, bounded JSON nesting.

urllib's timeout bounds each socket operation, not the request: a server that trickles one byte a
second keeps a read alive for as long as it likes, and a body is read whole however large. Here a
timer shuts the connection down at the deadline, whatever phase it is in (connecting, the status
line, the headers, the body), a body is read in chunks and refused beyond `max_bytes`, and JSON is
refused unparsed when it nests deeper than a real answer would (the parser recurses).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import urllib.parse
from typing import Any

from gpuwatch.errors import GpuwatchError

CHUNK = 65536
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class PeerError(GpuwatchError):
    """The peer did not answer in time, answered too much, or answered what cannot be read; one line."""


def get(url: str, deadline_s: float, max_bytes: int) -> tuple[int, bytes]:
    """(status, body) of `GET url`, all of it within `deadline_s` seconds and at most `max_bytes` of body.

    Raises:
        PeerError: unreachable, over the deadline, a body over `max_bytes`, or a broken answer.
    """
    if deadline_s <= 0:
        raise PeerError("no time left before the deadline")
    parts = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "", parts.port, timeout=deadline_s)
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        if connection.sock is not None:  # the base class's shutdown: an SSL socket's would race the reading thread
            try:
                socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    timer.start()
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", target, headers={"Accept": "application/json", "Connection": "close"})
        response = connection.getresponse()
        declared = response.getheader("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise PeerError(f"an answer of {int(declared)} bytes, over the limit of {max_bytes}")
        chunks: list[bytes] = []
        size = 0
        while chunk := response.read(CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise PeerError(f"an answer of more than {max_bytes} bytes")
            chunks.append(chunk)
        return response.status, b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):  # the timer, or one socket operation timing out first
            raise PeerError(f"no whole answer within {deadline_s:g} s") from None
        raise PeerError(str(getattr(exc, "strerror", None) or exc) or type(exc).__name__) from None
    finally:
        timer.cancel()
        connection.close()


def nesting_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in the JSON text `raw` (strings skipped), without parsing it."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def loads(raw: bytes, max_depth: int) -> Any:
    """The JSON value of `raw`, refused unparsed beyond `max_depth` levels of nesting.

    Raises:
        PeerError: not JSON, or nested too deeply.
    """
    if nesting_depth(raw) > max_depth:
        raise PeerError(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise PeerError(f"not JSON: {exc}") from None
