"""A Prometheus stand-in on loopback that answers /api/v1/query well or, on request, as badly as a peer can.

Real sockets, real HTTP: what gpuwatch reads is exactly what a broken or hostile server would send.
`mode` may change while it runs; every request counts in `requests`.

* ok: one sample of `value` (a string, as Prometheus writes it: "0.25", "NaN", "+Inf", "-3")
* deep: a JSON answer nested DEEP levels deep
* trickle: the status line, the headers and the body, one byte a second
* huge: `Content-Length: HUGE_BYTES` and zeros until the client goes away
* huge_unsized: no Content-Length (`Connection: close`), zeros until the client goes away
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from typing import Any

DEEP = 100_000
HUGE_BYTES = 1_500_000_000


def sample_body(value: str) -> bytes:
    return json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, value]}]}}
    ).encode()


class BadPrometheus:
    def __init__(self, mode: str = "ok", value: str = "0") -> None:
        self.mode = mode
        self.value = value
        self.requests = 0
        self.sent_bytes = 0
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                conn: socket.socket = self.request
                conn.settimeout(30)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                owner.requests += 1
                try:
                    owner.answer(conn)
                except OSError:
                    pass  # the client hung up: what a deadline or a size limit does

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        mode = self.mode
        if mode == "ok":
            self._send(conn, 200, sample_body(self.value))
        elif mode == "deep":
            self._send(conn, 200, b'{"status": "success", "data": ' + b"[" * DEEP + b"]" * DEEP + b"}")
        elif mode == "trickle":
            body = sample_body("0")
            for byte in _head(len(body)) + body:
                conn.sendall(bytes([byte]))
                self.sent_bytes += 1
                time.sleep(1.0)
        elif mode in ("huge", "huge_unsized"):
            sized = mode == "huge"
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {HUGE_BYTES}\r\n".encode() if sized else b"Connection: close\r\n"
            conn.sendall(head + b"\r\n")
            zeros = b"0" * 65536
            while self.sent_bytes < HUGE_BYTES:
                conn.sendall(zeros)
                self.sent_bytes += len(zeros)
        else:
            raise ValueError(mode)

    def _send(self, conn: socket.socket, status: int, body: bytes) -> None:
        conn.sendall(_head(len(body), status) + body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> BadPrometheus:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _head(length: int, status: int = 200) -> bytes:
    return (
        f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
