"""The fleet breaker keeps one connection to Prometheus: asked every cache_s, it does not connect every time.

A real HTTP/1.1 server on loopback (keep-alive, as Prometheus) counts the connections it accepts.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gpuwatch.cluster.fleet import QUARANTINED_SHARE, FleetError, Prometheus

ANSWER = json.dumps(
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "0.25"]}]}}
).encode()


class KeepAliveServer:
    """Answers every query with one sample; counts connections; `drop()` closes them as an idle timeout does."""

    def __init__(self) -> None:
        self.connections = 0
        self.delay_s = 0.0
        self.open: list[socket.socket] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                owner.connections += 1
                owner.open.append(self.connection)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                time.sleep(owner.delay_s)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(ANSWER)))
                self.end_headers()
                self.wfile.write(ANSWER)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def drop(self) -> None:
        for sock in self.open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.open.clear()


@pytest.fixture
def server() -> Iterator[KeepAliveServer]:
    keep_alive = KeepAliveServer()
    yield keep_alive
    keep_alive.drop()
    keep_alive.server.shutdown()


def test_asks_share_one_connection(server: KeepAliveServer) -> None:
    client = Prometheus(server.url, 2.0)

    assert [client.scalar(QUARANTINED_SHARE) for _ in range(20)] == [0.25] * 20
    assert server.connections == 1


def test_a_connection_the_server_closed_is_made_again_within_the_ask(server: KeepAliveServer) -> None:
    client = Prometheus(server.url, 2.0)
    client.scalar(QUARANTINED_SHARE)
    server.drop()  # Prometheus's idle timeout, or a restart
    time.sleep(0.1)

    assert client.scalar(QUARANTINED_SHARE) == 0.25  # no failure counted for a connection that aged out
    assert server.connections == 2


def test_an_ask_past_its_deadline_fails_in_time_and_the_next_connects_again(server: KeepAliveServer) -> None:
    client = Prometheus(server.url, 0.5)
    client.scalar(QUARANTINED_SHARE)
    server.delay_s = 2.0
    started = time.monotonic()
    with pytest.raises(FleetError, match="no whole answer within 0.5 s"):
        client.scalar(QUARANTINED_SHARE)
    assert time.monotonic() - started < 1.5
    server.delay_s = 0.0

    assert client.scalar(QUARANTINED_SHARE) == 0.25
    assert server.connections == 2  # the one cut at the deadline is not used again
