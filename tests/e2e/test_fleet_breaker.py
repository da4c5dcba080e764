"""The fleet breaker against a real Prometheus scraping three sim daemons.

A and B each have GPUs an operator quarantined (3 of the fleet's 12, 25 %); B and C ask
Prometheus before an automatic quarantine, with a limit of 20 %. A drill's XID 79 on C is then
refused (log, metric, alert); with A and B drained in Slurm (a stand-in scontrol), so is C's
drain. With Prometheus stopped, C (on_unreachable open) falls back to its
node breaker, which still allows one automatic quarantine and refuses the next; B (closed) refuses.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, free_port, wait_until
from tests.helpers import fake_scontrol, metric_value
from tests.prometheus_stack import prometheus_process

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _metric(daemon: DaemonProcess, name: str) -> float:
    return metric_value(daemon.text("/metrics"), name)


def _inject_xid79(daemon: DaemonProcess, gpu: int) -> None:
    """An XID 79 event on `gpu` through the daemon's inject API: unhealthy at once, so an automatic quarantine."""
    token = (daemon.state_dir / "token").read_text().strip()
    request = urllib.request.Request(
        f"{daemon.url}/v1/gpus/{gpu}/inject",
        data=json.dumps({"event": "xid", "xid": 79, "duration_s": 60}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).close()


def _scalar(result: list[dict[str, Any]]) -> float | None:
    return float(result[0]["value"][1]) if len(result) == 1 else None


def _log(daemon: DaemonProcess) -> str:
    return (daemon.state_dir.parent / "daemon.log").read_text()


def test_fleet_breaker_refuses_beyond_its_share_and_falls_back_without_prometheus(tmp_path: Path) -> None:
    daemons: dict[str, DaemonProcess] = {}
    prometheus = None
    port = free_port()
    fleet = {"GPUWATCH_FLEET_PROMETHEUS_URL": f"http://127.0.0.1:{port}", "GPUWATCH_FLEET_MAX_QUARANTINED_SHARE": "0.2",
             "GPUWATCH_FLEET_CACHE_S": "1", "GPUWATCH_FLEET_TIMEOUT_S": "1"}  # fmt: skip
    args = ("--sim-scenario", "healthy", "--sim-gpus", "4", "--interval", "1")
    scontrol: dict[str, str] = {}
    nodes: dict[str, Path] = {}
    for name in "abc":
        (tmp_path / name).mkdir()
        scontrol[name], nodes[name] = fake_scontrol(tmp_path / name)
    try:
        for name, env in (
            ("a", {}),
            ("b", {**fleet, "GPUWATCH_FLEET_ON_UNREACHABLE": "closed"}),
            ("c", {**fleet, "GPUWATCH_FLEET_MAX_DRAINED_NODES": "2"}),
        ):
            slurm = {"GPUWATCH_SLURM_ENABLED": "1", "GPUWATCH_SLURM_DRAIN_ON": "any_quarantine",
                     "GPUWATCH_SLURM_SCONTROL": scontrol[name]}  # fmt: skip
            daemons[name] = DaemonProcess(tmp_path / name, *args, env={**env, **slurm}).start()
        a, b, c = daemons["a"], daemons["b"], daemons["c"]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "dashboards/prometheus/gpuwatch-alerts.yml"),
                           str(ROOT / "dashboards/prometheus/gpuwatch-recording.yml")],
            "scrape_configs": [{"job_name": "gpuwatch", "static_configs": [
                {"targets": [f"127.0.0.1:{d.port}" for d in (a, b, c)]}]}],
        }  # fmt: skip
        prometheus = prometheus_process(tmp_path, config, port).start()
        query, alerts = prometheus.query, prometheus.alerts
        wait_until("the recording rules loaded", lambda: len(query("fleet:gpuwatch_gpus_quarantined:ratio")) == 1)
        for daemon, gpu in ((a, 0), (a, 1), (b, 0)):
            assert daemon.cli("quarantine", str(gpu), "--reason", "ci").returncode == 0
        wait_until(
            "Prometheus sees 3 of 12 GPUs quarantined",
            lambda: [float(r["value"][1]) for r in query("fleet:gpuwatch_gpus_quarantined:ratio")] == [0.25],
        )

        # A quarantine is judged on the breaker's last reading (never waited for): let C read the share first.
        wait_until("C's breaker reads 25 %", lambda: _metric(c, "gpuwatch_fleet_quarantined_ratio") == 0.25)
        _inject_xid79(c, 1)
        wait_until("C refuses", lambda: "fleet breaker refused the quarantine" in _log(c))
        assert "25.0% of the fleet's GPUs are quarantined, at or above fleet.max_quarantined_share 20.0%" in _log(c)
        assert not c.get("/v1/gpus/1")["quarantined"]
        assert _metric(c, "gpuwatch_fleet_breaker_refusals_total") == 1
        assert _metric(c, "gpuwatch_fleet_breaker_tripped") == 1
        c_instance = f"127.0.0.1:{c.port}"
        wait_until(
            "GpuwatchFleetBreakerRefused firing for C",
            lambda: any(
                x["labels"]["alertname"] == "GpuwatchFleetBreakerRefused"
                and x["labels"]["instance"] == c_instance
                and x["state"] == "firing"
                for x in alerts()
            ),
        )

        # A and B drained themselves in Slurm; with 2 nodes drained, C's drain (after an operator's
        # quarantine, which the breaker does not hold back) is refused.
        wait_until(
            "Prometheus counts 2 drained nodes", lambda: _scalar(query("fleet:gpuwatch_slurm_drained_nodes:sum")) == 2
        )
        assert nodes["a"].exists() and nodes["b"].exists()
        assert c.cli("quarantine", "3", "--reason", "ci").returncode == 0
        wait_until("C's drain refused", lambda: _metric(c, "gpuwatch_slurm_drain_refused") == 1)
        assert "fleet breaker refuses to drain node" in _log(c)
        assert "2 node(s) drained by gpuwatch in the last 3600 s, at or above fleet.max_drained_nodes 2" in _log(c)
        assert not nodes["c"].exists() and _metric(c, "gpuwatch_fleet_breaker_refusals_total") == 2

        prometheus.stop()
        wait_until("C falls back to its node breaker and quarantines GPU 1", lambda: c.get("/v1/gpus/1")["quarantined"])
        assert "cannot ask Prometheus" in _log(c) and "the node breaker alone decides" in _log(c)
        assert _metric(c, "gpuwatch_fleet_prometheus_up") == 0
        _inject_xid79(c, 2)
        wait_until("C's node breaker refuses GPU 2", lambda: "circuit breaker refused the quarantine" in _log(c))
        assert not c.get("/v1/gpus/2")["quarantined"]

        wait_until("B's breaker has noticed", lambda: _metric(b, "gpuwatch_fleet_prometheus_up") == 0)
        _inject_xid79(b, 1)
        wait_until("B (closed) refuses", lambda: "fleet.on_unreachable is closed" in _log(b))
        assert not b.get("/v1/gpus/1")["quarantined"]
    finally:
        if prometheus is not None:
            prometheus.stop()
        for daemon in daemons.values():
            daemon.stop()
