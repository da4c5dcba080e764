"""A stand-in for the daemon, as a local user would run one: it answers like gpuwatch and writes down
everything it is sent (`--log`, one JSON line per request: method, path, headers).

    python -m tests.impostor --tcp PORT --log FILE         # on the daemon's port while it is down
    python -m tests.impostor --unix PATH --log FILE        # a socket planted where the CLI looks
    python -m tests.impostor --unix PATH --log FILE --user UID:GID   # bound here, listened on as that user

Stdlib only: it runs as a throwaway user, outside the test process. It says every GPU is healthy and
not quarantined, and that any change it is asked for was made.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import socketserver
from http.server import BaseHTTPRequestHandler
from typing import Any

GPUS = [
    {"index": i, "uuid": f"GPU-fake-{i}", "name": "NVIDIA H200", "state": "healthy", "quarantined": False,
     "findings": [], "epoch": 0, "suggested_action": "none"}
    for i in range(8)
]  # fmt: skip


def handler(log_path: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _note(self) -> None:
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps({"method": self.command, "path": self.path, "headers": dict(self.headers)}) + "\n")

        def _answer(self, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._note()
            self._answer({"t": 0, "backend": "nvml", "gpus": GPUS} if self.path.startswith("/v1/gpus") else {})

        def do_POST(self) -> None:  # noqa: N802
            self._note()
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self._answer({**GPUS[0], "changed": True, "message": "done (by the impostor)"})

        def address_string(self) -> str:
            return "peer"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, handler_class: type[BaseHTTPRequestHandler], user: str) -> None:
        super().__init__(path, handler_class, bind_and_activate=False)
        self.server_bind()  # bound as whoever started this process (root, for --user)
        os.chmod(path, 0o666)
        if user:
            uid, gid = (int(part) for part in user.split(":"))
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)  # ... and listened on as that user: the kernel records who listens
        self.server_activate()


class TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tcp", type=int)
    parser.add_argument("--unix")
    parser.add_argument("--log", required=True)
    parser.add_argument("--user", default="")
    parser.add_argument("--ready", help="a file to create once listening")
    args = parser.parse_args()
    open(args.log, "a").close()
    if args.unix:
        server: socketserver.BaseServer = UnixServer(args.unix, handler(args.log), args.user)
    else:
        server = TcpServer(("127.0.0.1", args.tcp), handler(args.log))
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.ready:
        open(args.ready, "w").close()
    server.serve_forever()


if __name__ == "__main__":
    main()
