"""gpuwatch drains and resumes a real Slurm node: munged, slurmctld and slurmd on 127.0.0.1, sim daemons.

The node `gwnode` is this machine under a private slurm.conf; SLURM_CONF in the daemon's
environment is all gpuwatch needs to find it (it runs the real scontrol).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, wait_until
from tests.e2e.slurmctl import NODE, Slurm, start_slurm
from tests.helpers import metric_value

pytestmark = pytest.mark.slow
SIM_4_GPUS = ("--sim-scenario", "healthy", "--sim-gpus", "4", "--interval", "1")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


@pytest.fixture
def node(slurm: Slurm) -> Iterator[Slurm]:
    slurm.reset()
    yield slurm
    slurm.reset()


def _daemon(tmp_path: Path, slurm: Slurm, **env: str) -> DaemonProcess:
    settings = {
        "SLURM_CONF": slurm.env["SLURM_CONF"],
        "GPUWATCH_SLURM_ENABLED": "true",
        "GPUWATCH_SLURM_NODE_NAME": NODE,
        "GPUWATCH_SLURM_DRAIN_ON": "any_quarantine",
        **env,
    }
    return DaemonProcess(tmp_path, *SIM_4_GPUS, env=settings).start()


_until = functools.partial(wait_until, timeout_s=10.0)


def _metric(daemon: DaemonProcess, name: str) -> float:
    return metric_value(daemon.text("/metrics"), name)


def test_quarantine_drains_release_resumes_and_a_restart_keeps_the_drain_ours(node: Slurm, tmp_path: Path) -> None:
    daemon = _daemon(tmp_path, node)
    try:
        uuid = daemon.get("/v1/gpus/2")["uuid"]
        assert daemon.cli("quarantine", "2", "--reason", "bad fan").returncode == 0
        took = _until("node drained", node.drained)
        state, reason = node.node()
        assert reason == f"gpuwatch: GPU 2 {uuid} quarantined: bad fan", (state, reason)
        _until("gpuwatch_slurm_drained 1", lambda: _metric(daemon, "gpuwatch_slurm_drained") == 1)
        assert _metric(daemon, "gpuwatch_slurm_drains_total") == 1
        print(f"\nslurm: drained {took:.2f} s after `gpuwatch quarantine 2`")
    finally:
        daemon.stop()

    daemon = _daemon(tmp_path, node)  # same state dir: GPU 2 stays quarantined, the drain is recognised as ours
    try:
        _until("gpuwatch_slurm_drained 1 after a restart", lambda: _metric(daemon, "gpuwatch_slurm_drained") == 1)
        assert _metric(daemon, "gpuwatch_slurm_drains_total") == 0  # recognised, not drained again
        assert daemon.cli("release", "2").returncode == 0
        _until("node resumed", lambda: not node.drained())
        assert node.node()[1] == ""
        _until("gpuwatch_slurm_resumes_total 1", lambda: _metric(daemon, "gpuwatch_slurm_resumes_total") == 1)
    finally:
        daemon.stop()


def test_an_operators_drain_survives_quarantine_and_release(node: Slurm, tmp_path: Path) -> None:
    node.scontrol("update", f"NodeName={NODE}", "State=DRAIN", "Reason=maintenance")
    daemon = _daemon(tmp_path, node)
    try:
        assert daemon.cli("quarantine", "2", "--reason", "test").returncode == 0
        _until("gpuwatch sees the operator's drain", lambda: _metric(daemon, "gpuwatch_slurm_drained_by_other") == 1)
        assert daemon.cli("release", "2").returncode == 0
        time.sleep(2)  # the drainer has had the release; a resume would have happened by now
        assert node.drained() and node.node()[1] == "maintenance"
        assert _metric(daemon, "gpuwatch_slurm_drained") == 0
        assert _metric(daemon, "gpuwatch_slurm_drains_total") == _metric(daemon, "gpuwatch_slurm_resumes_total") == 0
    finally:
        daemon.stop()
    assert "drained by someone else (maintenance)" in (tmp_path / "daemon.log").read_text()


@pytest.mark.parametrize("scontrol", ["missing", "hanging"])
def test_scontrol_missing_or_hanging_does_not_stop_the_daemon(node: Slurm, tmp_path: Path, scontrol: str) -> None:
    program = tmp_path / "scontrol"
    if scontrol == "hanging":
        program.write_text("#!/bin/sh\nexec sleep 60\n")
        program.chmod(0o755)
    daemon = _daemon(tmp_path, node, GPUWATCH_SLURM_SCONTROL=str(program), GPUWATCH_SLURM_TIMEOUT_S="0.5")
    try:
        started = time.monotonic()
        assert daemon.cli("quarantine", "2", "--reason", "test").returncode == 0
        _until("a failure counted", lambda: _metric(daemon, "gpuwatch_slurm_scontrol_failures_total") >= 2)
        assert _metric(daemon, "gpuwatch_slurm_scontrol_failing") == 1
        samples = daemon.get("/v1/gpus/0")["sample"]["t"]
        time.sleep(1.5)
        assert daemon.get("/v1/gpus/0")["sample"]["t"] > samples, "sampling stalled"
        assert daemon.get("/v1/gpus/2")["quarantined"] and time.monotonic() - started < 10
        assert daemon.process.poll() is None
    finally:
        daemon.stop()
    log = (tmp_path / "daemon.log").read_text()
    assert ("not found (slurm.scontrol)" if scontrol == "missing" else "no answer within 0.5 s") in log
    assert "retry 2 in 2 s" in log
    assert not node.drained()


def test_check_slurm_drains_and_resumes_from_the_running_daemon(node: Slurm, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, *SIM_4_GPUS).start()
    env = {
        "SLURM_CONF": node.env["SLURM_CONF"],
        "GPUWATCH_SLURM_NODE_NAME": NODE,
        "GPUWATCH_SLURM_DRAIN_ON": "any_quarantine",
    }
    try:
        uuid = daemon.get("/v1/gpus/2")["uuid"]
        assert daemon.cli("quarantine", "2", "--reason", "test").returncode == 0
        check = daemon.cli("check", "--slurm", env=env)
        assert check.returncode == 0, check.stdout + check.stderr  # the GPUs are healthy: exit codes as before
        assert f"slurm: node {NODE} drained" in check.stdout
        assert node.node()[1] == f"gpuwatch: GPU 2 {uuid} quarantined: test"
        again = daemon.cli("check", "--slurm", env=env)
        assert f"slurm: node {NODE} unchanged" in again.stdout
        assert daemon.cli("release", "2").returncode == 0
        check = daemon.cli("check", "--slurm", env=env)
        assert check.returncode == 0 and f"slurm: node {NODE} resumed" in check.stdout, check.stdout + check.stderr
        assert not node.drained()
    finally:
        daemon.stop()
