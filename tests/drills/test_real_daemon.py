"""Drills against a real daemon process (sim backend, 1 s interval, loopback port, temp dirs): the CLI and a
fault_injection script over real HTTP, real sampling for a windowed rule, and a verdict that fails when
the rule is disabled. Under ~20 s in all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.drills.conftest import main
from tests.helpers import metric_samples

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

SIM = {"GPUWATCH_SIM_SCENARIO": "healthy", "GPUWATCH_SIM_GPUS": "2", "GPUWATCH_INTERVAL_S": "1"}


class Daemon(DaemonProcess):
    """A sim daemon set up through GPUWATCH_* variables; `settings` are those variables and the ones that find it,
    so a drill run in this process or a script's judges with the daemon's own settings (interval, rule windows)."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        super().__init__(tmp_path, env={**SIM, **env})
        self.settings = {
            "GPUWATCH_CONFIG": "",
            "GPUWATCH_BACKEND": "sim",
            "GPUWATCH_LISTEN": self.listen,
            "GPUWATCH_STATE_DIR": str(self.state_dir),
            "GPUWATCH_RUNTIME_DIR": str(self.runtime_dir),
            **SIM,
            **env,
        }

    def drill(self, *args: str) -> Any:
        return CliRunner().invoke(main, ["drill", *args], env=self.settings)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with Daemon(tmp_path, GPUWATCH_RULES_CLOCK_WINDOW_S="5") as daemon:
        yield daemon


def test_inject_drills_pass_against_a_running_daemon(daemon: Daemon) -> None:
    event = daemon.drill("--inject", "gpu=0,preset=xid79")
    assert event.exit_code == 0, (event.stdout, event.stderr, daemon.log_text())

    sampled = daemon.drill("--inject", "gpu=1,preset=clock_low,for=60", "--json")
    assert sampled.exit_code == 0, (sampled.stdout, sampled.stderr)
    finding = json.loads(sampled.stdout)["steps"][1]
    assert finding["name"] == "finding" and finding["detail"].startswith("sm_clock_low_unexplained (degraded")
    assert 3.0 <= finding["duration_s"] <= 10.0, "5 s window at level_duty 0.8, sampled every second"

    runs = daemon.get("/v1/drills")["runs"]
    assert [(r["spec"], r["result"]) for r in runs] == [
        ("gpu=1,preset=clock_low,for=60", "pass"),
        ("gpu=0,preset=xid79", "pass"),
    ]
    text = daemon.text("/metrics")
    assert metric_samples(text, "gpuwatch_drill_runs_total") == [({"drill": "inject", "result": "pass"}, 2.0)]
    (last,) = metric_samples(text, "gpuwatch_drill_last_run_timestamp_seconds")
    assert last[0] == {"drill": "inject", "result": "pass"} and abs(last[1] - time.time()) < 60


def test_the_fault_injection_script_runs_as_its_own_process(daemon: Daemon) -> None:
    script = ROOT / "fault_injection" / "inject.py"
    done = subprocess.run(
        [sys.executable, str(script), "gpu=1,preset=ecc_dbe", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **daemon.settings},
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert json.loads(done.stdout)["steps"][1]["detail"].startswith("ecc_uncorrectable (unhealthy")
    assert daemon.get("/v1/gpus/1")["quarantined"] is True


def test_verdict_fails_when_the_daemon_does_not_react(tmp_path: Path) -> None:
    with Daemon(tmp_path, GPUWATCH_RULES_DISABLED="xid") as blind:
        result = blind.drill("--inject", "gpu=1,preset=xid79")
        assert result.exit_code == 1, (result.stdout, result.stderr)
        assert "drill inject FAILED at step finding: not within 2 s: GPU 1 findings: none" in result.stderr
        (run,) = blind.get("/v1/drills")["runs"]
        assert run["result"] == "fail" and run["broke_at"] == "finding"
        text = blind.text("/metrics")
        assert [labels for labels, _ in metric_samples(text, "gpuwatch_drill_last_run_timestamp_seconds")] == [
            {"drill": "inject", "result": "fail"}
        ]


def test_a_drill_run_inside_the_daemon_goes_through_its_own_api(daemon: Daemon) -> None:
    token = daemon.token
    body = json.dumps({"drill": "inject", "gpu": "1", "args": "preset=ecc_dbe"}).encode()
    request = urllib.request.Request(
        daemon.url + "/v1/drills/run",
        data=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 202
    deadline = time.monotonic() + 15
    while not (runs := daemon.get("/v1/drills")["runs"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    (run,) = runs
    assert (run["trigger"], run["result"], run["gpu"]) == ("api", "pass", 1), run
    assert daemon.get("/v1/gpus/1")["quarantined"] is True
