"""Asking a peer server (Prometheus) without trusting it: one deadline for the whole request, a bounded
body, bounded JSON nesting.

urllib's timeout bounds each socket operation, not the request: a server that trickles one byte a
second keeps a read alive for as long as it likes, and a body is read whole however large. Here a
timer shuts the connection down at the deadline, whatever phase it is in (connecting, the status
line, the headers, the body), a body is read in chunks and refused beyond `max_bytes`, and JSON is
refused unparsed when it nests deeper than a real answer would (the parser recurses). A `Peer` keeps
its connection open between asks (HTTP keep-alive) and makes a new one after any error.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from typing import Any

from gpuwatch.errors import GpuwatchError

CHUNK = 65536
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class PeerError(GpuwatchError):
    """The peer did not answer in time, answered too much, or answered what cannot be read; one line."""


class Peer:
    """One server asked again and again: over one kept-alive connection, made again after any error.

    A node's breaker asks the same Prometheus every `cache_s` for as long as it runs; a connection
    per ask is a TCP (and TLS) set-up per ask on the server, times every node of the fleet. An ask
    that finds the kept connection closed by the server (its idle timeout) is sent once more on a
    new one, within the same deadline. Two asks at once (the share's thread and a drain) never wait
    for each other: the second uses a connection of its own, closed after.
    """

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname or "", parts.port
        self._lock = threading.Lock()
        self._kept: http.client.HTTPConnection | None = None
        self.connections = 0  # made so far

    def get(self, target: str, deadline_s: float, max_bytes: int) -> tuple[int, bytes]:
        """(status, body) of `GET target` (path and query), all of it within `deadline_s` seconds and at most
        `max_bytes` of body.

        Raises:
            PeerError: unreachable, over the deadline, a body over `max_bytes`, or a broken answer.
        """
        if deadline_s <= 0:
            raise PeerError("no time left before the deadline")
        if not self._lock.acquire(blocking=False):  # the kept connection is busy with another ask
            return self._once(target, deadline_s, max_bytes)
        try:
            started = time.monotonic()
            connection: http.client.HTTPConnection | None = self._kept
            self._kept = None
            if connection is not None:
                try:
                    answer = _exchange(connection, target, deadline_s, max_bytes, reused=True)
                except _Stale:
                    connection = None
                    deadline_s -= time.monotonic() - started
                    if deadline_s <= 0:
                        raise PeerError("no time left before the deadline") from None
            if connection is None:
                connection = self._connect(deadline_s)
                answer = _exchange(connection, target, deadline_s, max_bytes, reused=False)
            if connection.sock is not None:  # not closed by an answer that said `Connection: close`
                self._kept = connection
            return answer
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if self._kept is not None:
                self._kept.close()
                self._kept = None

    def _once(self, target: str, deadline_s: float, max_bytes: int) -> tuple[int, bytes]:
        """An ask on a connection of its own, closed after."""
        connection = self._connect(deadline_s)
        try:
            return _exchange(connection, target, deadline_s, max_bytes, reused=False)
        finally:
            connection.close()

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        self.connections += 1
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=timeout_s)


class _Stale(Exception):
    """A kept connection the server had closed: the ask goes again on a new one."""


def _exchange(
    connection: http.client.HTTPConnection, target: str, deadline_s: float, max_bytes: int, *, reused: bool
) -> tuple[int, bytes]:
    """One request and its whole answer on `connection`, within `deadline_s`; the connection is closed on
    any error (a timer shuts it down at the deadline, whatever phase it is in)."""
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
        if connection.sock is not None:
            connection.sock.settimeout(deadline_s)
        connection.request("GET", target or "/", headers={"Accept": "application/json"})
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
    except PeerError:
        connection.close()
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        connection.close()
        if expired.is_set() or isinstance(exc, TimeoutError):  # the timer, or one socket operation timing out first
            raise PeerError(f"no whole answer within {deadline_s:g} s") from None
        if reused and isinstance(exc, (ConnectionError, http.client.BadStatusLine)):
            raise _Stale() from None
        raise PeerError(str(getattr(exc, "strerror", None) or exc) or type(exc).__name__) from None
    finally:
        timer.cancel()


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
