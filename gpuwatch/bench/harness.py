"""What the measurements share: the run's context, a `gpuwatch run` subprocess, keep-alive HTTP, statistics.

Every daemon the bench starts is a real `python -m gpuwatch run` process on 127.0.0.1 with its own
config file, state dir and runtime dir under the bench's temp dir, and without the caller's GPUWATCH_*
variables, so a node's configuration never leaks in and the bench never touches the node's daemon.
Unless a measurement asks otherwise it never quarantines a GPU (`policy.quarantine_on_unhealthy =
false`): a quarantine signals the processes on that GPU, and on a real node those are someone's job.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import click

ConfigTables = Mapping[str, Mapping[str, float | int | bool | str]]

READY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Context:
    """One bench run's settings: which backend and how many GPUs, quick or full, and where to put files."""

    backend: str
    gpus: int
    quick: bool
    footprint_s: float
    workdir: Path

    def pick(self, full: float, quick: float) -> float:
        """A size or duration for this mode."""
        return quick if self.quick else full


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the table)."""
    click.echo(f"bench: {message}", err=True)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of already sorted values."""
    return sorted_values[max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))]


def summarize(values_s: Sequence[float], unit: str) -> dict[str, float]:
    """Mean, p50 and p99 of durations in seconds, in `unit` (us or ms), and how many there were."""
    scale = {"us": 1e6, "ms": 1e3, "s": 1.0}[unit]
    ordered = sorted(values_s)
    return {
        f"mean_{unit}": sum(ordered) / len(ordered) * scale,
        f"p50_{unit}": percentile(ordered, 0.50) * scale,
        f"p99_{unit}": percentile(ordered, 0.99) * scale,
        "n": len(ordered),
    }


def free_port() -> int:
    """A port the kernel says is free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def child_env() -> dict[str, str]:
    """This process's environment without GPUWATCH_* (flags and the bench's config file say everything)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}


def toml_text(tables: ConfigTables) -> str:
    """A TOML file of [section] tables of scalars (all a bench config needs)."""
    lines: list[str] = []
    for section, values in tables.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


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


class Service:
    """A server subprocess (the daemon or a peer exporter) whose stderr goes to a log file.

    Raises (from start):
        RuntimeError: it exited or did not answer `ready_path` with 200 in time; names its last log line.
    """

    def __init__(self, name: str, args: list[str], port: int, log_path: Path, ready_path: str = "/metrics") -> None:
        self.name = name
        self.args = args
        self.port = port
        self.log_path = log_path
        self.ready_path = ready_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.proc.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log, env=child_env()
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        http = Http(self.port, timeout_s=5.0)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {self.log_tail()}")
                try:
                    if http.request("GET", self.ready_path)[0] == 200:
                        return
                except OSError:
                    pass
                time.sleep(0.1)
        finally:
            http.close()
        raise RuntimeError(f"{self.name} did not answer {self.ready_path} within {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s. Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self) -> str:
        """The last non-empty line of its log, for a one-line error."""
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return lines[-1].strip() if lines else "(empty log)"

    def __enter__(self) -> Service:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Daemon(Service):
    """`gpuwatch run` on the bench's backend, at `interval_s`, with `tables` as its config file."""

    def __init__(self, ctx: Context, name: str, interval_s: float, tables: ConfigTables | None = None) -> None:
        self.root = ctx.workdir / name
        self.state_dir = self.root / "state"
        self.runtime_dir = self.root / "run"
        self.interval_s = interval_s
        port = free_port()
        self.listen = f"127.0.0.1:{port}"
        merged: dict[str, dict[str, Any]] = {"policy": {"quarantine_on_unhealthy": False}}
        for section, values in (tables or {}).items():
            merged.setdefault(section, {}).update(values)
        self.config_path = self.root / "gpuwatch.toml"
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(toml_text(merged), encoding="utf-8")
        args = [sys.executable, "-m", "gpuwatch", "run", "--config", str(self.config_path)]
        args += ["--backend", ctx.backend, "--interval", f"{interval_s:g}", "--listen", self.listen]
        args += ["--state-dir", str(self.state_dir), "--runtime-dir", str(self.runtime_dir), "--log-level", "warning"]
        if ctx.backend == "sim":
            args += ["--sim-gpus", str(ctx.gpus), "--sim-scenario", "healthy", "--seed", "0"]
        super().__init__(f"gpuwatch run ({name})", args, port, self.root / "daemon.log", ready_path="/healthz")

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text(encoding="utf-8").strip()

    def __enter__(self) -> Daemon:
        super().__enter__()
        return self


def nvitop_exporter(ctx: Context, name: str, interval_s: float = 1.0) -> Service | None:
    """nvitop-exporter as its own process (`python -m nvitop_exporter`) on a free port; None when not installed."""
    if importlib.util.find_spec("nvitop_exporter") is None:
        return None
    port = free_port()
    args = [sys.executable, "-m", "nvitop_exporter", "--bind-address", "127.0.0.1", "--port", str(port)]
    args += ["--interval", f"{interval_s:g}"]
    return Service(f"nvitop-exporter ({name})", args, port, ctx.workdir / f"nvitop-{name}.log")


def exposition_size(body: bytes) -> dict[str, int]:
    """Bytes and series (non-comment lines) of one Prometheus exposition."""
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return {"bytes": len(body), "series": series}
