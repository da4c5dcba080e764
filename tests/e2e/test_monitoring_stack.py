"""gpuwatch → Prometheus → Alertmanager → webhook receivers, all real programs on 127.0.0.1.

One stack per module: gpuwatch (sim, demo scenario, 1 s interval), Prometheus (scrape and rule
evaluation every 1 s, the repo's alert and recording rules), Alertmanager (the repo's routing with
short group timers, receivers pointed at a webhook server of the test). The tests then check what
the pager, chat and drill receivers got, and that every Grafana panel query returns data.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import RunningDaemon, free_port, start_daemon, stop_daemon
from tests.test_grafana_dashboard import dashboard_queries

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER), reason="Debian packages prometheus(-alertmanager) missing"),
]


@dataclass
class Notification:
    receiver: str
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]


@dataclass
class Stack:
    daemon: RunningDaemon
    prometheus: str
    alertmanager: str
    received: list[Notification] = field(default_factory=list)

    def wait_for(self, what: str, predicate: Callable[[Notification], bool], timeout: float = 90) -> Notification:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for note in list(self.received):
                if predicate(note):
                    return note
            time.sleep(0.25)
        seen = [(n.receiver, n.status, n.labels.get("alertname"), n.labels.get("gpu")) for n in self.received]
        raise AssertionError(f"no notification: {what}; received {seen}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", (promql, body)
        return list(body["data"]["result"])


def _webhook(received: list[Notification]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            for alert in body["alerts"]:
                received.append(
                    Notification(self.path.strip("/"), alert["status"], alert["labels"], alert["annotations"])
                )
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready: {log.read_text()[-3000:]}")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    received: list[Notification] = []
    webhook = _webhook(received)
    am_port, prom_port = free_port(), free_port()

    am_config = yaml.safe_load(
        (ROOT / "dashboards/alertmanager/alertmanager.yml")
        .read_text()
        .replace("127.0.0.1:9999", f"127.0.0.1:{webhook.server_port}")
    )
    am_config["route"].update(group_wait="1s", group_interval="1s")
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am_config))

    daemon = start_daemon(tmp, "--sim-scenario", "demo", "--interval", "1")
    prom_config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ROOT / "dashboards/prometheus/gpuwatch-alerts.yml"),
                       str(ROOT / "dashboards/prometheus/gpuwatch-recording.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [
            {"job_name": "gpuwatch", "static_configs": [{"targets": [f"127.0.0.1:{daemon.port}"],
                                                         "labels": {"cluster": "ci"}}]}
        ],
    }  # fmt: skip
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_config))

    processes = [
        _spawn(
            [ALERTMANAGER or "", f"--config.file={tmp / 'alertmanager.yml'}", f"--storage.path={tmp / 'am'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            tmp / "alertmanager.log",
        ),
        _spawn(
            [PROMETHEUS or "", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp / "prometheus.log",
        ),
    ]  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{am_port}/-/ready", processes[0], tmp / "alertmanager.log")
        _wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", processes[1], tmp / "prometheus.log")
        yield Stack(daemon, f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", received)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        stop_daemon(daemon)
        webhook.shutdown()


def test_unhealthy_gpu_pages_with_uuid_and_runbook(stack: Stack) -> None:
    uuid = stack.daemon.get("/v1/gpus/5")["uuid"]
    page = stack.wait_for(
        "GpuwatchGpuUnhealthy for GPU 5 at the pager",
        lambda n: n.receiver == "pager" and n.labels.get("alertname") == "GpuwatchGpuUnhealthy"
        and n.labels.get("gpu") == "5" and n.status == "firing",
    )  # fmt: skip
    assert page.labels["uuid"] == uuid
    assert uuid in page.annotations["summary"]
    assert page.annotations["runbook_url"].endswith("#runbook-gpuwatchgpuunhealthy")
    assert page.labels["drill"] == "false"


def test_inject_drill_alerts_the_drill_receiver_not_the_pager(stack: Stack) -> None:
    result = stack.daemon.cli("drill", "--inject", "gpu=1,remapped_pending=1,for=30", "--no-wait")
    if result.returncode != 0:  # the drill CLI takes over the injection where present; the API is the contract
        token = (stack.daemon.state_dir / "token").read_text().strip()
        request = urllib.request.Request(
            f"{stack.daemon.base}/v1/gpus/1/inject",
            data=json.dumps({"fields": {"remapped_pending": 1}, "duration_s": 30}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=5).close()
    drill = stack.wait_for(
        "GpuwatchGpuUnhealthy for GPU 1 at the drill receiver",
        lambda n: n.receiver == "drill" and n.labels.get("alertname") == "GpuwatchGpuUnhealthy"
        and n.labels.get("gpu") == "1",
    )  # fmt: skip
    assert drill.labels["drill"] == "true"
    time.sleep(3)  # a few group intervals: a misrouted copy would have reached the pager by now
    paged_gpu1 = [n for n in stack.received if n.receiver == "pager" and n.labels.get("gpu") == "1"]
    assert paged_gpu1 == []


def test_quarantine_alert_resolves_after_release(stack: Stack) -> None:
    stack.wait_for(
        "GpuwatchGpuQuarantined for GPU 5",
        lambda n: n.labels.get("alertname") == "GpuwatchGpuQuarantined" and n.labels.get("gpu") == "5"
        and n.status == "firing",
    )  # fmt: skip
    released = stack.daemon.cli("release", "5", "--reason", "ci: replaced")
    assert released.returncode == 0, released.stderr
    stack.wait_for(
        "GpuwatchGpuQuarantined for GPU 5 resolved",
        lambda n: n.labels.get("alertname") == "GpuwatchGpuQuarantined" and n.labels.get("gpu") == "5"
        and n.status == "resolved",
    )  # fmt: skip


def test_every_grafana_query_parses_and_returns_data(stack: Stack) -> None:
    empty = []
    for promql in dashboard_queries():
        if not stack.query(promql):
            empty.append(promql)
    assert empty == [], f"{len(empty)} panel queries returned no data"
