"""gpuwatch → Prometheus → Alertmanager → webhook receivers, all real programs on 127.0.0.1.

One stack per module: gpuwatch (sim, demo scenario, 1 s interval), Prometheus (scrape and rule
evaluation every 1 s, the repo's alert and recording rules), Alertmanager (the repo's routing with
short group timers, receivers pointed at a webhook server of the test). The tests then check what
the pager, chat and drill receivers got, and that every Grafana panel query returns data.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.prometheus_stack import Prometheus, Webhook, alertmanager_config, alertmanager_process, prometheus_process
from tests.reporting import FakeRank
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
    daemon: DaemonProcess
    prometheus: Prometheus
    webhook: Webhook

    @property
    def received(self) -> list[Notification]:
        return [
            Notification(path.strip("/"), alert["status"], alert["labels"], alert["annotations"])
            for path, alert in list(self.webhook.received)
        ]

    def wait_for(self, what: str, predicate: Callable[[Notification], bool], timeout: float = 90) -> Notification:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for note in self.received:
                if predicate(note):
                    return note
            time.sleep(0.25)
        seen = [(n.receiver, n.status, n.labels.get("alertname"), n.labels.get("gpu")) for n in self.received]
        raise AssertionError(f"no notification: {what}; received {seen}")


class FakeJob:
    """Three ranks of one job, as live processes reporting over the daemon's socket, and its relaunch.

    Ranks sit on GPUs 0, 3 and 5: GPU 3 is the demo's throttling GPU (its rank is the slow one, a
    straggler on a throttling GPU) and GPU 5 gets the demo's ECC error, so the daemon quarantines it
    and signals the whole job. Once every rank is gone the job "relaunches" on GPUs 0 and 3 with new
    PIDs and a later step, as `gpuwatch launch` would: that gives the incident its resume time.
    """

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.uuids = {g["index"]: g["uuid"] for g in daemon.get("/v1/gpus")["gpus"]}
        self.step = 100
        self.ranks = self._launch([0, 3, 5])
        self.relaunched = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _launch(self, gpus: list[int]) -> list[tuple[FakeRank, int]]:
        return [(FakeRank(), gpu) for gpu in gpus]

    def _report(self, rank: int, process: FakeRank, gpu: int) -> None:
        body = {
            "t": time.time(), "rank": rank, "local_rank": rank, "world_size": len(self.ranks),
            "local_world_size": len(self.ranks), "job_id": "ci-job", "gpu_uuid": self.uuids[gpu],
            "step": self.step, "step_time_s": 1.0 if gpu == 3 else 0.5, "grad_norm": 1.0, "grad_norm_var": 0.01,
            "reserved_bytes": 10 << 30, "allocated_bytes": 6 << 30, "inactive_split_bytes": 1 << 30,
            "num_alloc_retries": 2, "num_ooms": 0, "stop_requested": False,
        }  # fmt: skip
        process.report(self.daemon.runtime_dir, **body)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            alive = [(p, gpu) for p, gpu in self.ranks if p.poll() is None]
            if not alive and not self.relaunched:
                self.relaunched = True
                self.step += 1
                self.ranks = alive = self._launch([0, 3])
            for rank, (process, gpu) in enumerate(alive):
                with contextlib.suppress(OSError, AssertionError):  # stopped by the daemon as we spoke to it
                    self._report(rank, process, gpu)
            self.step += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for process, _ in self.ranks:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    args = ("--sim-scenario", "demo", "--interval", "1")
    with contextlib.ExitStack() as running:
        webhook = running.enter_context(Webhook())
        alertmanager = running.enter_context(alertmanager_process(tmp, alertmanager_config(webhook)))
        # Slow fields (PCIe replay, violation counters) every 2 s, so their rate() panels have data.
        daemon = running.enter_context(DaemonProcess(tmp, *args, env={"GPUWATCH_SLOW_INTERVAL_S": "2"}))
        job = FakeJob(daemon)
        running.callback(job.close)
        prom_config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "dashboards/prometheus/gpuwatch-alerts.yml"),
                           str(ROOT / "dashboards/prometheus/gpuwatch-recording.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager.port}"]}]}]},
            "scrape_configs": [
                {"job_name": "gpuwatch", "static_configs": [{"targets": [f"127.0.0.1:{daemon.port}"],
                                                             "labels": {"cluster": "ci"}}]}
            ],
        }  # fmt: skip
        prometheus = running.enter_context(prometheus_process(tmp, prom_config))
        yield Stack(daemon, prometheus, webhook)


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
    result = stack.daemon.cli("drill", "--inject", "gpu=1,preset=xid79,for=30")
    assert result.returncode == 0, result.stdout + result.stderr
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
    refused = stack.daemon.cli("release", "5", "--reason", "ci: replaced")  # its ECC finding is still active
    assert refused.returncode == 2 and "ecc_uncorrectable" in refused.stderr, refused.stderr
    released = stack.daemon.cli("release", "5", "--force", "--reason", "ci: replaced")
    assert released.returncode == 0, released.stderr
    stack.wait_for(
        "GpuwatchGpuQuarantined for GPU 5 resolved",
        lambda n: n.labels.get("alertname") == "GpuwatchGpuQuarantined" and n.labels.get("gpu") == "5"
        and n.status == "resolved",
    )  # fmt: skip


def test_every_grafana_query_parses_and_returns_data(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    empty = dashboard_queries()
    while empty and time.monotonic() < deadline:  # the incident's resume and the rate() windows need a moment
        empty = [promql for promql in dashboard_queries() if not stack.prometheus.query(promql)]
        time.sleep(2)
    assert empty == [], f"{len(empty)} panel queries returned no data"
