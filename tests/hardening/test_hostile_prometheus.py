"""A bad Prometheus cannot stall a real daemon: sampling stays on time and an XID 79 still quarantines.

Every node asks the same Prometheus for the fleet breaker. Before, the ask ran inside the state
machine's step on the sampling thread: a NaN or ±Inf count or deeply nested JSON raised there every
round (/healthz stale, an XID 79 GPU never quarantined), a body trickled at 1 byte/s held sampling
for a minute despite `timeout_s`, and a 1.5 GB body took the daemon past its memory limit.

Each case: a daemon whose Prometheus (tests/bad_prometheus.py, real HTTP on loopback) first answers
well, then badly. An XID 79 is judged at once on the breaker's last reading and its GPU quarantined;
the breaker's thread, reading the share every second, counts the bad answer unreachable
(on_unreachable open: the node breaker decides), and a second XID 79 is quarantined too; meanwhile
/healthz never shows a sample more than one interval late and the daemon's memory does not grow.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, wait_until
from tests.bad_prometheus import BadPrometheus
from tests.helpers import metric_value

pytestmark = pytest.mark.slow
INTERVAL_S = 1.0
TIMEOUT_S = 5.0  # long, so that a trickled answer keeps the breaker's thread busy while sampling is watched


class Watch:
    """Polls /healthz and the daemon's RSS from a thread: the worst sample age and the largest RSS seen."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.worst_age_s = 0.0
        self.peak_rss = 0
        self.process = psutil.Process(daemon.pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                with urllib.request.urlopen(self.daemon.url + "/healthz", timeout=5) as response:
                    body = json.loads(response.read())
            except urllib.error.HTTPError as exc:
                body = json.loads(exc.read())
            self.worst_age_s = max(self.worst_age_s, body["last_sample_age_s"])
            self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def inject_xid79(daemon: DaemonProcess, gpu: int) -> None:
    request = urllib.request.Request(
        f"{daemon.url}/v1/gpus/{gpu}/inject",
        data=json.dumps({"event": "xid", "xid": 79, "duration_s": 600}).encode(),
        headers={"Authorization": f"Bearer {daemon.token}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture
def bad() -> Iterator[BadPrometheus]:
    with BadPrometheus("ok", "0") as server:
        yield server


@pytest.mark.parametrize(
    ("mode", "value"),
    [("ok", "NaN"), ("ok", "+Inf"), ("ok", "-1"), ("deep", ""), ("trickle", ""), ("huge", ""), ("huge_unsized", "")],
)
def test_a_bad_prometheus_never_holds_sampling_or_a_quarantine(
    tmp_path: Path, bad: BadPrometheus, mode: str, value: str
) -> None:
    env = {
        "GPUWATCH_FLEET_PROMETHEUS_URL": bad.url,
        "GPUWATCH_FLEET_CACHE_S": "1",
        "GPUWATCH_FLEET_TIMEOUT_S": str(TIMEOUT_S),
        "GPUWATCH_POLICY_BREAKER_MAX_SHARE": "1.0",  # the node breaker allows both quarantines
    }
    args = ("--sim-scenario", "healthy", "--sim-gpus", "4", "--interval", str(INTERVAL_S))
    with DaemonProcess(tmp_path, *args, env=env) as daemon:
        wait_until(
            "the breaker's first answer",
            lambda: metric_value(daemon.text("/metrics"), "gpuwatch_fleet_prometheus_up") == 1,
        )
        rss_before = psutil.Process(daemon.pid).memory_info().rss
        asked_before = bad.requests
        bad.mode, bad.value = mode, value
        with Watch(daemon) as watch:
            inject_xid79(daemon, 1)
            wait_until("GPU 1 quarantined on the last good answer", lambda: daemon.get("/v1/gpus/1")["quarantined"], 3)
            wait_until(
                "the bad answer counted as unreachable",
                lambda: metric_value(daemon.text("/metrics"), "gpuwatch_fleet_query_failures_total") >= 1,
                TIMEOUT_S + 5,
            )
            assert bad.requests > asked_before
            assert metric_value(daemon.text("/metrics"), "gpuwatch_fleet_prometheus_up") == 0
            inject_xid79(daemon, 2)
            wait_until(
                "GPU 2 quarantined by the node breaker alone", lambda: daemon.get("/v1/gpus/2")["quarantined"], 3
            )
            time.sleep(2 * INTERVAL_S)
        assert watch.worst_age_s <= 2 * INTERVAL_S + 0.5, f"{mode}: a sample {watch.worst_age_s:.2f} s old"
        assert watch.peak_rss - rss_before < 64 << 20, f"{mode}: RSS grew by {(watch.peak_rss - rss_before) >> 20} MiB"
        assert "cannot ask Prometheus" in daemon.log_text() and "Traceback" not in daemon.log_text()
