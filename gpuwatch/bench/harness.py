"""What the measurements share besides the processes they start (daemons) and their statistics (stats):
the run's context, progress lines, keep-alive HTTP to a server, the size of an exposition.

Every daemon the bench starts is a real `python -m gpuwatch run` process (daemons.bench_daemon)
on 127.0.0.1 with its own config file, state dir and runtime dir under the bench's temp dir, and
without the caller's GPUWATCH_* variables, so a node's configuration never leaks in and the bench never
touches the node's daemon.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click


@dataclass(frozen=True)
class InterferenceFlags:
    """The interference section's flags; None is the default of the mode (interference/section.py)."""

    rounds_s: float | None = None  # the monitors' interleaved rounds, every step kind together
    segment_s: float | None = None  # one timed segment of the monitors' rounds
    conditions: tuple[str, ...] | None = None  # what runs beside the job (interference/section.py CONDITIONS)
    steps: tuple[str, ...] | None = None  # the job's step kinds (short, long)
    restart: bool = True  # start and stop each monitor around its segments (False: freeze it between them)
    event_set_s: float | None = None  # the event-set probe: an idle NVML event set against none (0: not run)
    attribute_s: float | None = None  # each call kind's segment in the attribution (0: no attribution)
    attribute_rate: float | None = None  # calls a second the attribution's helper makes


@dataclass(frozen=True)
class Context:
    """One bench run's settings: which backend and how many GPUs, quick or full, and where to put files."""

    backend: str
    gpus: int
    quick: bool
    footprint_s: float
    workdir: Path
    interference: InterferenceFlags = InterferenceFlags()

    def pick(self, full: float, quick: float) -> float:
        """A size or duration for this mode."""
        return quick if self.quick else full


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the table)."""
    click.echo(f"bench: {message}", err=True)


class Http:
    """One keep-alive HTTP/1.1 connection to 127.0.0.1:port; reconnects after an error.

    A GET on a connection the server closed while it sat idle (uvicorn drops idle ones after 5 s) is
    sent again once on a new connection, as HTTP clients do; anything else is raised.
    """

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)

    def request(self, method: str, path: str, body: bytes | None = None, token: str = "") -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            return self._send(method, path, body, headers)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if method != "GET":
                raise
            return self._send(method, path, body, headers)

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        """One request; on any failure the connection is closed, so the next request opens a new one."""
        try:
            self._conn.request(method, path, body=body, headers=headers)
            response = self._conn.getresponse()
            return response.status, response.read()
        except (http.client.HTTPException, OSError):
            self._conn.close()
            raise

    def get_json(self, path: str) -> Any:
        status, body = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    def post_json(self, path: str, payload: Mapping[str, Any], token: str) -> Any:
        status, body = self.request("POST", path, json.dumps(payload).encode(), token)
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    def close(self) -> None:
        self._conn.close()


def exposition_size(body: bytes) -> dict[str, int]:
    """Bytes and series (non-comment lines) of one Prometheus exposition."""
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return {"bytes": len(body), "series": series}
