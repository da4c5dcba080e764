"""remediation.py in a sim daemon: a quarantine stops the job's ranks (real processes), incidents, resume, metrics."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from gpuwatch.errors import ConfigError
from gpuwatch.remediation import Remediation, parse_signal
from gpuwatch.serving.remediation_metrics import RemediationCollector
from tests.helpers import SimNode, metric_samples, start_sim_node
from tests.remediation.conftest import Spawn
from tests.reporting import FakeRank

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[SimNode, TestClient, Remediation]]:
    """A sim daemon; Daemon installs remediation itself (remediation.install in Daemon.__init__)."""
    sim = start_sim_node(tmp_path, gpus=4, **{"trainer.grace_period_s": 0.5, "trainer.kill_after_s": 0.5})
    yield sim, sim.client, sim.daemon.remediation
    sim.close()


def write_report(sim: SimNode, process: FakeRank, **fields: Any) -> None:
    """A trainer's report as TrainerLink sends it (the fake clock's time unless `t` is given)."""
    process.report(sim.daemon.config.runtime_dir, **{"t": sim.clock.t, **fields})


def uuid(sim: SimNode, index: int) -> str:
    return sim.daemon.monitor.statics[index].uuid


def wait_incident(client: TestClient, status: str, timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        incidents = client.get("/v1/incidents").json()["incidents"]
        if incidents and incidents[0]["status"] == status:
            return dict(incidents[0])
        time.sleep(0.05)
    raise AssertionError(f"no incident reached {status!r}: {incidents}")


@pytest.mark.slow
def test_quarantine_stops_the_whole_job_escalates_and_times_the_resume(
    node: tuple[SimNode, TestClient, Remediation], spawn: Spawn
) -> None:
    sim, client, _ = node
    rank0, rank1, rank2, bystander = (spawn(b) for b in ("cooperative", "ignores_stop", "ignores_term", "cooperative"))
    job = {"job_id": "job-1", "world_size": 3}
    write_report(sim, rank0, rank=0, gpu_uuid=uuid(sim, 1), step=40, **job)
    write_report(sim, rank1, rank=1, gpu_uuid=uuid(sim, 0), step=40, **job)
    write_report(sim, rank2, rank=2, gpu_uuid=uuid(sim, 2), step=39, **job)
    write_report(sim, bystander, rank=0, gpu_uuid=uuid(sim, 3), step=7, job_id="job-2")
    sim.run_for(5)
    decided = sim.clock.t

    started = time.monotonic()
    response = client.post("/v1/gpus/1/quarantine", json={"reason": "test"}, headers=sim.auth)
    assert response.status_code == 200
    assert time.monotonic() - started < 0.5, "the stop must not hold up the API (or the sampling thread)"

    incident = wait_incident(client, "stopped")
    assert (incident["gpu"], incident["uuid"], incident["cause"], incident["job"]) == (1, uuid(sim, 1), "test", "job-1")
    assert (incident["t"], incident["auto"], incident["stop_signal"]) == (decided, False, "SIGUSR1")
    ended = {r["pid"]: r["ended"] for r in incident["ranks"]}
    assert ended == {rank0.pid: "exited", rank1.pid: "SIGTERM", rank2.pid: "SIGKILL"}
    assert [r["on_quarantined_gpu"] for r in incident["ranks"]] == [True, False, False]
    assert rank0.wait(5) == 75 and rank1.wait(5) == -15 and rank2.wait(5) == -9
    assert 1.0 <= incident["time_to_stop_s"] < 5.0  # 0.5 s grace + 0.5 s until SIGKILL
    assert incident["last_step"] == 40 and incident["time_to_resume_s"] is None
    assert bystander.poll() is None, "another job's rank must never be signalled"

    # The relaunched job: a new process of the same job reports a step, 7 s (trainer time) after the decision.
    resumed = spawn("cooperative")
    write_report(sim, resumed, rank=0, gpu_uuid=uuid(sim, 0), step=38, t=decided + 7.0, **job)
    incident = wait_incident(client, "resumed")
    assert (incident["time_to_resume_s"], incident["resumed_step"], incident["steps_lost"]) == (7.0, 38, 2)

    metrics = client.get("/metrics").text
    assert metric_samples(metrics, "gpuwatch_incidents_total") == [({}, 1.0)]
    assert metric_samples(metrics, "gpuwatch_incident_time_to_resume_seconds") == [({}, 7.0)]
    assert metric_samples(metrics, "gpuwatch_incident_steps_lost") == [({}, 2.0)]
    (stop,) = metric_samples(metrics, "gpuwatch_incident_time_to_stop_seconds")
    assert stop[1] == incident["time_to_stop_s"]


def test_a_quarantine_with_no_trainers_is_an_incident_without_a_stop(
    node: tuple[SimNode, TestClient, Remediation],
) -> None:
    sim, client, _ = node

    client.post("/v1/gpus/2/quarantine", json={"reason": "idle card"}, headers=sim.auth)

    incident = wait_incident(client, "no_trainers")
    assert (incident["gpu"], incident["ranks"], incident["time_to_stop_s"], incident["job"]) == (2, [], 0.0, None)


def test_trainers_route_and_metrics_carry_ranks_and_findings(
    node: tuple[SimNode, TestClient, Remediation], spawn: Spawn
) -> None:
    sim, client, remediation = node
    ranks = [spawn("cooperative") for _ in range(3)]
    gib = 2**30
    for i, child in enumerate(ranks):
        write_report(
            sim,
            child,
            rank=i,
            job_id="job-9",
            gpu_uuid=uuid(sim, i),
            step=100,
            step_time_s=0.9 if i == 2 else 0.5,
            reserved_bytes=10 * gib,
            allocated_bytes=4 * gib,
            num_alloc_retries=3,
            grad_norm_var=0.25,
        )
    sim.run_for(5)

    body = client.get("/v1/trainers").json()  # the in-process client is nobody the kernel names: no pids
    assert [(r["pid"], r["gpu"], r["rank"], r["sources"]) for r in body["ranks"]] == [
        (0, i, i, ["report"]) for i in range(3)
    ]
    assert [r.pid for r in remediation.ranks()[0]] == [child.pid for child in ranks]
    (finding,) = body["findings"]
    assert (finding["rule"], finding["gpu"], finding["severity"]) == ("trainer_straggler", 2, "warning")
    gpu2 = client.get("/v1/gpus/2").json()
    assert [(r["pid"], r["rank"]) for r in gpu2["ranks"]] == [(ranks[2].pid, 2)]
    assert [f["rule"] for f in gpu2["trainer_findings"]] == ["trainer_straggler"]
    assert finding["reason"].startswith("rank 2 of job job-9 is 80% slower than its peers")

    metrics = client.get("/metrics").text
    labels = {"gpu": "2", "uuid": uuid(sim, 2), "rank": "2", "job_id": "job-9"}
    assert (labels, 0.6) in metric_samples(metrics, "gpuwatch_trainer_memory_fragmentation_ratio")
    assert (labels, 0.9) in metric_samples(metrics, "gpuwatch_trainer_step_time_seconds")
    assert (labels, 3.0) in metric_samples(metrics, "gpuwatch_trainer_alloc_retries_total")
    assert ({**labels, "gpu_throttling": "false"}, 1.0) in metric_samples(metrics, "gpuwatch_trainer_straggler")
    assert ({**labels, "rank": "0", "gpu": "0", "uuid": uuid(sim, 0), "gpu_throttling": "false"}, 0.0) in (
        metric_samples(metrics, "gpuwatch_trainer_straggler")
    )
    variance = [({"job_id": "job-9", "uid": str(os.getuid())}, 0.25)]
    assert metric_samples(metrics, "gpuwatch_trainer_grad_norm_variance") == variance
    assert metric_samples(metrics, "gpuwatch_incidents_total") == [({}, 0.0)]


@pytest.mark.slow
def test_incident_counter_survives_a_restart(tmp_path: Path) -> None:
    first = start_sim_node(tmp_path, gpus=2)
    first.daemon.monitor.quarantine(0, "before restart")
    deadline = time.monotonic() + 5
    while not first.daemon.store.incidents() and time.monotonic() < deadline:
        time.sleep(0.02)
    first.close()

    second = start_sim_node(tmp_path, gpus=2)
    try:
        registry = CollectorRegistry()
        registry.register(RemediationCollector(second.daemon.remediation))
        assert registry.get_sample_value("gpuwatch_incidents_total") == 1.0
    finally:
        second.close()


@pytest.mark.parametrize(("name", "expected"), [("SIGUSR1", "SIGUSR1"), ("usr2", "SIGUSR2"), ("15", "SIGTERM")])
def test_parse_signal(name: str, expected: str) -> None:
    assert parse_signal(name).name == expected


def test_a_bad_stop_signal_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.stop_signal: 'SIGNOPE' is not a signal"):
        start_sim_node(tmp_path, gpus=1, **{"trainer.stop_signal": "SIGNOPE"})
