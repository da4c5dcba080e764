"""Fixtures for end-to-end tests: a real `gpuwatch run` process on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningDaemon:
    """A `gpuwatch run` subprocess and how to reach it."""

    process: subprocess.Popen[str]
    port: int
    state_dir: Path
    runtime_dir: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cli_args(self) -> list[str]:
        return ["--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state_dir)]

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=5) as resp:
            return json.loads(resp.read())

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuwatch", *args, *self.cli_args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env} if env else None,
        )


def start_daemon(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1"
) -> RunningDaemon:
    port = free_port()
    state, runtime = tmp_path / "state", tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "gpuwatch", "run", "--backend", "sim", "--listen", f"{host}:{port}",
            "--state-dir", str(state), "--runtime-dir", str(runtime), *args,
        ],
        stdout=open(tmp_path / "daemon.log", "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "GPUWATCH_CONFIG": "", **(env or {})},
    )  # fmt: skip
    daemon = RunningDaemon(process, port, state, runtime)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError((tmp_path / "daemon.log").read_text())
        try:
            daemon.get("/healthz")
            return daemon
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("daemon did not start in 30 s: " + (tmp_path / "daemon.log").read_text())


def stop_daemon(daemon: RunningDaemon) -> None:
    daemon.process.terminate()
    try:
        daemon.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        daemon.process.kill()


@pytest.fixture
def demo_daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    daemon = start_daemon(tmp_path, "--sim-scenario", "demo", "--interval", "1")
    yield daemon
    stop_daemon(daemon)


@dataclass
class RunningPrometheus:
    """A real `prometheus` subprocess on a free loopback port."""

    process: subprocess.Popen[bytes]
    url: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", (promql, body)
        return list(body["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/api/v1/alerts", timeout=10) as resp:
            return list(json.loads(resp.read())["data"]["alerts"])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_prometheus(tmp_path: Path, config: dict[str, Any], port: int | None = None) -> RunningPrometheus:
    """Prometheus with `config` (a prometheus.yml as a dict), its TSDB and log in tmp_path; ready on return."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian package prometheus missing")
    port = port or free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    process = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    prometheus = RunningPrometheus(process, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            urllib.request.urlopen(prometheus.url + "/-/ready", timeout=1).close()
            return prometheus
        except OSError:
            time.sleep(0.2)
    prometheus.stop()
    raise RuntimeError(f"prometheus not ready in 60 s: {log.read_text()[-3000:]}")
