"""Limits of the HTTP server that must hold before any request reaches the app (and its token check).

uvicorn has no header timeout, no header size limit with its httptools parser, and accepts
connections until the process runs out of file descriptors, after which accept() fails (and
the event loop logs a traceback) on every retry while /metrics no longer answers. This module
closes those gaps at the protocol level:

* a request's line and headers must arrive within `header_timeout_s` (slowloris), else the
  connection is closed;
* more than `max_header_bytes` of request line and headers is answered 431 and closed;
* at `max_connections` open connections, a new one closes the longest-idle connection (one not
  serving a request), so a flood of idle sockets can neither exhaust file descriptors nor keep a
  Prometheus scrape out; the cap is kept below the fd limit;
* accept() errors (EMFILE and the like) are logged at most once a minute, one line each.

* a request body over `max_body_bytes` is answered 413 by ASGI middleware (`body_limit`) before
  routing and the token check read any of it.

On the control socket (a Unix socket) each connection carries its peer's credentials as the kernel
reports them (`peer(scope)`, from SO_PEERCRED at accept time), so the API can authorize by who is
calling; a TCP request has none, and `host_check` answers only the Host names it may (DNS rebinding).

`front` puts those ASGI layers before the app, and serves /metrics and /healthz itself; `lazy_app` lets the daemon
build its FastAPI app (FastAPI, starlette and pydantic: about 16 MiB) at the first request that needs it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpuwatch.control import peer as peer_cred
from gpuwatch.control.hosts import HostPolicy
from gpuwatch.control.peer import PeerCred
from gpuwatch.serving.viewer import PEER

log = logging.getLogger("gpuwatch.http")

# asyncio accepts up to the listen backlog in one go before the event loop closes any evicted
# connection, so the backlog is kept small and the fd reserve covers one such burst on top of
# what the database, NVML, the runtime dir and drill processes hold.
ACCEPT_BURST = 128
FD_RESERVE = 64 + ACCEPT_BURST
_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def peer(scope: Mapping[str, Any]) -> PeerCred | None:
    """Who is calling, as the kernel says, for a request on the control socket; None over TCP."""
    found = scope.get("extensions", {}).get(PEER)
    return found if isinstance(found, PeerCred) else None


@dataclass(frozen=True)
class ServerLimits:
    """What each connection may cost; `max_connections` is already capped below the fd limit."""

    max_connections: int = 1000
    header_timeout_s: float = 10.0
    max_header_bytes: int = 16384


def raise_fd_limit(wanted_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; the connection cap that fits below it.

    The unit sets LimitNOFILE above the default cap; run by hand under a low `ulimit -n`, the
    cap shrinks to fit and says so, so accept() never fails for want of descriptors.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fits = max(16, soft - FD_RESERVE)
    if wanted_connections > fits:
        log.warning(
            "api.max_connections %d does not fit the fd limit %d: capping connections at %d (raise LimitNOFILE)",
            wanted_connections,
            soft,
            fits,
        )
        return fits
    return wanted_connections


def limited_protocol(limits: ServerLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits` applied to every connection (`uvicorn.Config(http=...)`)."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.peer = _peer_of(transport)
            self.last_active = self.loop.time()
            self.awaiting_headers = True
            self.header_bytes = 0  # request line and headers, as the parser reports them
            self.raw_bytes = 0  # bytes received while waiting for headers
            self.header_deadline: asyncio.TimerHandle | None = None
            self._arm_deadline()
            if len(self.connections) > limits.max_connections:
                self._make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

        def idle(self) -> bool:
            """Not serving a request: waiting for one, or trickling one in (those are the cheap ones to close)."""
            return not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete)

        def _make_room(self) -> None:
            idle = [
                c for c in self.connections if isinstance(c, LimitedHttpToolsProtocol) and c is not self and c.idle()
            ]
            if idle:
                victim = min(idle, key=lambda c: c.last_active)
                victim.transport.close()
                return
            self._close_with(503, b"Service Unavailable")  # every connection is busy serving a request

        def _arm_deadline(self) -> None:
            if self.header_deadline is None:
                self.header_deadline = self.loop.call_later(limits.header_timeout_s, self._header_timed_out)

        def _cancel_deadline(self) -> None:
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None

        def _header_timed_out(self) -> None:
            self.header_deadline = None
            if self.awaiting_headers and not self.transport.is_closing():
                if self.raw_bytes:
                    self._close_with(408, b"Request Timeout")
                else:
                    self.transport.close()

        def _close_with(self, status: int, phrase: bytes) -> None:
            head = b"HTTP/1.1 %d %s\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % (status, phrase)
            self.transport.write(head)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            self.last_active = self.loop.time()
            if self.awaiting_headers:
                self.raw_bytes += len(data)
                self._arm_deadline()  # from the first byte of a request on a kept-alive connection
            super().data_received(data)
            if self.awaiting_headers and self.raw_bytes > limits.max_header_bytes and not self.transport.is_closing():
                self._close_with(431, b"Request Header Fields Too Large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self.peer is not None:
                extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
                extensions[PEER] = self.peer
            if not self.awaiting_headers:  # the next request on a kept-alive connection
                self.awaiting_headers = True
                self.header_bytes = 0
                self.raw_bytes = 0
                self._arm_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.pipeline and not self.transport.is_closing():  # idle until the next request's first byte
                self.awaiting_headers = True
                self.header_bytes = 0
                self.raw_bytes = 0

        def on_url(self, url: bytes) -> None:
            self.header_bytes += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.header_bytes += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.awaiting_headers = False
            self.raw_bytes = 0
            self._cancel_deadline()
            if self.header_bytes <= limits.max_header_bytes:
                super().on_headers_complete()
                return
            app = self.app
            self.app = _headers_too_large  # answered by uvicorn's usual request cycle, never by the app
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            if self.cycle is not None:
                self.cycle.keep_alive = False

    return LimitedHttpToolsProtocol


def _peer_of(transport: asyncio.Transport) -> PeerCred | None:
    """The credentials of a control-socket connection's peer; None for TCP (or if the kernel cannot say)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        return peer_cred.of(sock)
    except OSError:
        return None


async def _headers_too_large(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 431,
            "headers": [(b"content-type", b"text/plain"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": b"request line and headers too large\n"})


class AcceptErrorLog:
    """An event-loop exception handler that turns accept() failures into one line per interval.

    After EMFILE asyncio pauses accepting for a second, but one burst can fail up to the listen
    backlog times, each logged with a traceback (measured before: 163,654 tracebacks and 12 CPU-s
    in 20 s). ACCEPT_BURST bounds the burst; this handler makes the log one line per interval.
    Other errors go to the default handler.
    """

    def __init__(self, interval_s: float = 60.0, clock: Any = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.last = float("-inf")
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS and "accept" in context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = self.clock()
        if now - self.last < self.interval_s:
            self.suppressed += 1
            return
        log.error(
            "cannot accept connections: %s (%d more since the last line; retrying every second)",
            exc.strerror or exc,
            self.suppressed,
        )
        self.last = now
        self.suppressed = 0


ASGIApp = Callable[[dict[str, Any], Callable[..., Any], Callable[..., Any]], Awaitable[None]]


def body_limit(app: ASGIApp, max_bytes: int) -> ASGIApp:
    """413 for a request body over `max_bytes`, before routing and the token check read any of it.

    A declared Content-Length over the limit is refused unread; a chunked body is read up to the
    limit and handed on, so no request can make the daemon hold more than `max_bytes` of it.
    """
    too_large = [(b"content-type", b"application/json"), (b"connection", b"close")]

    async def refuse(send: Callable[..., Any]) -> None:
        body = json.dumps({"detail": f"request body over {max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": too_large})
        await send({"type": "http.response.body", "body": body})

    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared:
            if len(declared) > 1 or not declared[0].isdigit() or int(declared[0]) > max_bytes:
                await refuse(send)
                return
            await app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = scope["method"] not in {"GET", "HEAD"}
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                await refuse(send)
                return
            more = message.get("more_body", False)
        buffered = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Any:
            return buffered.pop() if buffered else await receive()

        await app(scope, replay if chunks else receive, send)

    return asgi


Answer = Callable[[], tuple[int, bytes, bytes]]  # () -> (status, content type, body)


def fast_paths(app: ASGIApp, answers: dict[str, Answer]) -> ASGIApp:
    """Answer GET and HEAD of the paths in `answers` before FastAPI's routing, request and response objects.

    A scrape is the hot path (every Prometheus server, every 15 s, often several at once) and its
    body is cached bytes, so the framework's per-request work is most of its cost: serving the
    bytes straight from ASGI roughly halves the latency under concurrent scrapes. A liveness probe
    is as frequent, and answered here it never loads the framework at all.
    """
    not_allowed = [(b"allow", b"GET, HEAD"), (b"content-length", b"0")]

    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        answer = answers.get(scope["path"]) if scope["type"] == "http" else None
        if answer is None:
            await app(scope, receive, send)
            return
        if scope["method"] not in {"GET", "HEAD"}:
            await send({"type": "http.response.start", "status": 405, "headers": not_allowed})
            await send({"type": "http.response.body", "body": b""})
            return
        status, content_type, body = answer()
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return asgi


def lazy_app(build: Callable[[], ASGIApp]) -> ASGIApp:
    """The app `build()` returns, built at the first request that reaches it, not at start.

    A node that is only scraped never pays for the API framework; the first API call pays its imports
    once (about half a second), on the event loop, where a second request waits for the same build.
    """
    built: list[ASGIApp] = []

    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if not built:
            built.append(build())
        await built[0](scope, receive, send)

    return asgi


def host_check(app: ASGIApp, hosts: HostPolicy) -> ASGIApp:
    """421 for a TCP request whose Host the daemon does not answer to (DNS rebinding), 400 without one.

    A control-socket request is not checked: no browser can send one, and its caller is known.
    """

    async def refuse(send: Callable[..., Any], status: int, why: str) -> None:
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"detail": why}).encode()})

    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or peer(scope) is not None:
            await app(scope, receive, send)
            return
        given = [v for k, v in scope["headers"] if k == b"host"]
        if len(given) != 1:
            await refuse(send, 400, "one Host header is required")
            return
        if not hosts.allows(given[0].decode("latin-1")):
            await refuse(send, 421, "this Host is not one the daemon answers to (api.allowed_hosts)")
            return
        await app(scope, receive, send)

    return asgi


def front(
    app: ASGIApp,
    render_metrics: Callable[[], bytes],
    healthz: Callable[[], tuple[int, bytes]],
    max_body_bytes: int,
    hosts: HostPolicy | None = None,
) -> ASGIApp:
    """What every request meets before `app`: the Host check (TCP), the body limit, then /metrics and /healthz
    answered at once. `hosts`: the names answered over TCP (None: loopback names and IP addresses)."""
    metrics_type = CONTENT_TYPE_LATEST.encode()

    def metrics() -> tuple[int, bytes, bytes]:
        return 200, metrics_type, render_metrics()

    def health() -> tuple[int, bytes, bytes]:
        status, body = healthz()
        return status, b"application/json", body

    limited = body_limit(fast_paths(app, {"/metrics": metrics, "/healthz": health}), max_body_bytes)
    return host_check(limited, hosts or HostPolicy(()))
