"""Prometheus and Alertmanager (Debian's packages) as real processes on free loopback ports, and the
webhook server Alertmanager's receivers are pointed at. A missing program skips the test."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatch.testing.daemon_process import ServerProcess, free_port

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
ALERTMANAGER_CONFIG = DASHBOARDS / "alertmanager" / "alertmanager.yml"


def program(*names: str) -> str:
    """The first of `names` on PATH; skips the test when none is installed."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.skip(f"{names[0]} is not installed (Debian: apt-get install prometheus prometheus-alertmanager)")


class Prometheus(ServerProcess):
    """A real `prometheus`, ready when /-/ready answers."""

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", (promql, body)
        return list(body["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/api/v1/alerts", timeout=10) as resp:
            return list(json.loads(resp.read())["data"]["alerts"])


def prometheus_process(root: Path, config: dict[str, Any], port: int | None = None) -> Prometheus:
    """Prometheus with `config` (a prometheus.yml as a dict), its TSDB and log in root; not started yet."""
    binary = program("prometheus")
    port = port or free_port()
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    argv = [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}"]
    argv.append(f"--web.listen-address=127.0.0.1:{port}")
    return Prometheus("prometheus", argv, port, root / "prometheus.log", ready_path="/-/ready")


def alertmanager_config(webhook: Webhook) -> dict[str, Any]:
    """The repo's alertmanager.yml with its receivers pointed at `webhook` and 1 s group timers."""
    text = ALERTMANAGER_CONFIG.read_text().replace("127.0.0.1:9999", f"127.0.0.1:{webhook.port}")
    config: dict[str, Any] = yaml.safe_load(text)
    config["route"].update(group_wait="1s", group_interval="1s")
    return config


def alertmanager_process(root: Path, config: dict[str, Any], port: int | None = None) -> ServerProcess:
    """Alertmanager with `config`, alone (no cluster), its data and log in root; not started yet."""
    binary = program("prometheus-alertmanager", "alertmanager")
    port = port or free_port()
    (root / "alertmanager.yml").write_text(yaml.safe_dump(config))
    argv = [binary, f"--config.file={root / 'alertmanager.yml'}", f"--storage.path={root / 'alertmanager'}"]
    argv += [f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    return ServerProcess("alertmanager", argv, port, root / "alertmanager.log", ready_path="/-/ready")


class Webhook:
    """An HTTP server on a free loopback port that keeps every alert Alertmanager posts, as (path, alert)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.extend((self.path, alert) for alert in body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_port
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Webhook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
