"""Drills against a real daemon process (sim backend, 1 s interval, loopback port, temp dirs): the CLI and a
fault_injection script over real HTTP, real sampling for a windowed rule, and a verdict that fails when
the rule is disabled. Under ~20 s in all."""

from __future__ import annotations

import json
import os
import socket
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

from tests.drills.conftest import main
from tests.helpers import metric_samples

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# `gpuwatch run`, which builds the drills itself.
LAUNCH = """
from gpuwatch.config import load
from gpuwatch.daemon import Daemon, setup_logging
config = load()
setup_logging(config.log_level)
Daemon(config).serve()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Daemon:
    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.env = {
            "GPUWATCH_CONFIG": "",
            "GPUWATCH_BACKEND": "sim",
            "GPUWATCH_SIM_SCENARIO": "healthy",
            "GPUWATCH_SIM_GPUS": "2",
            "GPUWATCH_INTERVAL_S": "1",
            "GPUWATCH_LISTEN": f"127.0.0.1:{free_port()}",
            "GPUWATCH_STATE_DIR": str(tmp_path / "state"),
            "GPUWATCH_RUNTIME_DIR": str(tmp_path / "run"),
            **env,
        }
        self.log = tmp_path / "daemon.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", LAUNCH], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.get("/healthz")
                return
            except (OSError, urllib.error.HTTPError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(self.log.read_text()) from None
                time.sleep(0.1)

    def url(self, path: str) -> str:
        return f"http://{self.env['GPUWATCH_LISTEN']}{path}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url(path), timeout=5) as resp:
            body = resp.read().decode()
        return body if path == "/metrics" else json.loads(body)

    def drill(self, *args: str) -> Any:
        return CliRunner().invoke(main, ["drill", *args], env=self.env)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path, GPUWATCH_RULES_CLOCK_WINDOW_S="5")
    yield daemon
    daemon.stop()


def test_inject_drills_pass_against_a_running_daemon(daemon: Daemon) -> None:
    event = daemon.drill("--inject", "gpu=0,preset=xid79")
    assert event.exit_code == 0, (event.stdout, event.stderr, daemon.log.read_text())

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
    text = daemon.get("/metrics")
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
        env={**os.environ, **daemon.env},
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert json.loads(done.stdout)["steps"][1]["detail"].startswith("ecc_uncorrectable (unhealthy")
    assert daemon.get("/v1/gpus/1")["quarantined"] is True


def test_verdict_fails_when_the_daemon_does_not_react(tmp_path: Path) -> None:
    blind = Daemon(tmp_path, GPUWATCH_RULES_DISABLED="xid")
    try:
        result = blind.drill("--inject", "gpu=1,preset=xid79")
        assert result.exit_code == 1, (result.stdout, result.stderr)
        assert "drill inject FAILED at step finding: not within 2 s: GPU 1 findings: none" in result.stderr
        (run,) = blind.get("/v1/drills")["runs"]
        assert run["result"] == "fail" and run["broke_at"] == "finding"
        text = blind.get("/metrics")
        assert [labels for labels, _ in metric_samples(text, "gpuwatch_drill_last_run_timestamp_seconds")] == [
            {"drill": "inject", "result": "fail"}
        ]
    finally:
        blind.stop()


def test_a_drill_run_inside_the_daemon_goes_through_its_own_api(daemon: Daemon) -> None:
    token = (Path(daemon.env["GPUWATCH_STATE_DIR"]) / "token").read_text().strip()
    body = json.dumps({"drill": "inject", "gpu": "1", "args": "preset=ecc_dbe"}).encode()
    request = urllib.request.Request(
        daemon.url("/v1/drills/run"),
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
