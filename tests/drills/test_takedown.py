"""reset_gpu and pcie_remove against fakes only: a fake daemon, a fake nvidia-smi that records argv, a fake
sysfs tree. Never a real `nvidia-smi -r` or sysfs write. Plus the guards against the sim daemon."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpuwatch.config import Config
from gpuwatch.drills.runner import DrillRefused, Request, prepare, run_drill
from gpuwatch.drills.steps import Verdict
from tests.drills.conftest import ClientApi, FakeDaemon, Tools, fake_gpu, sim_clock
from tests.helpers import SimNode

QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"]


def config(tools: Tools) -> Config:
    base = Config()
    drills = dataclasses.replace(base.drills, burn_in_s=30.0, detect_timeout_s=10.0)
    return tools.config(dataclasses.replace(base, interval_s=5.0, drills=drills))


def drill(fake: FakeDaemon, tools: Tools, kind: str, gpu: int = 0) -> Verdict:
    return run_drill(prepare(Request(kind, gpu), fake, config(tools), fake.clock()))


def test_reset_drill_takes_the_gpu_out_resets_it_and_brings_it_back(tools: Tools) -> None:
    fake = FakeDaemon([fake_gpu(0), fake_gpu(1)])
    verdict = drill(fake, tools, "reset_gpu")
    assert verdict.result == "pass", verdict.as_dict()
    assert [(s.name, s.result) for s in verdict.steps] == [
        ("quarantine", "pass"),
        ("trainers_left", "skip"),
        ("no_processes", "pass"),
        ("release_handles", "pass"),
        ("reset", "pass"),
        ("reacquire", "pass"),
        ("gpu_back", "pass"),
        ("released_after_burn_in", "pass"),
    ]
    assert tools.argv() == [QUERY, QUERY, ["nvidia-smi", "-r", "-i", "0"]]
    assert fake.paths() == [
        "/v1/gpus/0/quarantine",
        "/v1/backend/release",
        "/v1/backend/reacquire",
        "/v1/gpus/0/release",
    ]
    assert verdict.steps[-1].duration_s >= 30.0 and not fake.gpu(0)["quarantined"]


def test_reset_waits_for_the_trainers_to_leave(tools: Tools) -> None:
    trainer = {"pid": 4242, "rank": 3, "job_id": "job-7"}
    fake = FakeDaemon([fake_gpu(0, trainers=[trainer], sample={"t": 0.0, "pids": [4242]})])
    asked: list[float] = []

    def trainer_leaves(daemon: FakeDaemon) -> None:
        gpu = daemon.gpu(0)
        if gpu["quarantined"] and not asked:
            asked.append(daemon.t)
        if asked and daemon.t - asked[0] >= 12:  # the rank checkpoints for 12 s, then exits
            gpu.update(trainers=[], sample={**gpu["sample"], "pids": []})

    fake.react = trainer_leaves
    verdict = drill(fake, tools, "reset_gpu")
    assert verdict.result == "pass", verdict.as_dict()
    left = next(s for s in verdict.steps if s.name == "trainers_left")
    assert left.result == "pass" and 12.0 <= left.duration_s <= 13.0
    assert "rank 3 (pid 4242)" in left.detail


def test_a_process_left_after_the_trainers_breaks_the_chain_before_any_reset(tools: Tools) -> None:
    fake = FakeDaemon([fake_gpu(0)])
    fake.react = lambda daemon: tools.apps.write_text("GPU-fake-0, 999\n") if daemon.gpu(0)["quarantined"] else None
    verdict = drill(fake, tools, "reset_gpu")
    assert verdict.result == "fail" and verdict.broke_at == "no_processes"
    steps = {s.name: s for s in verdict.steps}
    assert "processes [999] are on GPU 0; it stays quarantined" in steps["no_processes"].detail
    assert steps["reacquire"].result == "skip", "handles never released, nothing to take back"
    assert ["nvidia-smi", "-r", "-i", "0"] not in tools.argv()
    assert "/v1/backend/release" not in fake.paths()


def test_a_failed_reset_still_hands_the_nvml_handles_back(tools: Tools) -> None:
    tools.fail_reset()
    fake = FakeDaemon([fake_gpu(0)])
    verdict = drill(fake, tools, "reset_gpu")
    assert verdict.result == "fail" and verdict.broke_at == "reset"
    steps = {s.name: s for s in verdict.steps}
    assert "In use by another client" in steps["reset"].detail
    assert steps["reacquire"].result == "pass" and steps["gpu_back"].result == "not_run"
    assert fake.paths()[-1] == "/v1/backend/reacquire"
    assert fake.gpu(0)["quarantined"], "a GPU whose reset failed stays out of service"


def test_pcie_drill_removes_and_rescans_through_sysfs(tools: Tools) -> None:
    fake = FakeDaemon([fake_gpu(0), fake_gpu(1)])
    verdict = drill(fake, tools, "pcie_remove", gpu=1)
    assert verdict.result == "pass", verdict.as_dict()
    device = tools.sysfs / "bus/pci/devices/0000:1b:00.0"
    assert (device / "remove").read_text() == "1"
    assert (tools.sysfs / "bus/pci/rescan").read_text() == "1"
    assert (tools.sysfs / "bus/pci/devices/0000:18:00.0/remove").read_text() == "", "GPU 0 untouched"
    names = [s.name for s in verdict.steps]
    assert names[4:8] == ["remove", "rescan", "device_back", "reacquire"]
    assert not [argv for argv in tools.argv() if "-r" in argv]


@pytest.mark.parametrize("kind", ["reset_gpu", "pcie_remove"])
def test_busy_gpu_is_refused_before_anything_happens(tools: Tools, kind: str) -> None:
    fake = FakeDaemon([fake_gpu(0, sample={"t": 0.0, "pids": [31337]})])
    with pytest.raises(DrillRefused, match=r"GPU 0 has processes that are not trainers on it \(\[31337\]\)"):
        prepare(Request(kind, 0), fake, config(tools), fake.clock())
    assert fake.posts == []


def test_a_process_only_nvidia_smi_sees_is_refused_too(tools: Tools) -> None:
    tools.apps.write_text("GPU-fake-0, 555\n")
    fake = FakeDaemon([fake_gpu(0)])
    with pytest.raises(DrillRefused, match=r"\[555\]"):
        prepare(Request("reset_gpu", 0), fake, config(tools), fake.clock())


def test_pcie_refuses_a_gpu_sysfs_does_not_have(tools: Tools) -> None:
    fake = FakeDaemon([fake_gpu(0, pci_bus_id="00000000:99:00.0")])
    with pytest.raises(DrillRefused, match="0000:99:00.0/remove does not exist") as refused:
        prepare(Request("pcie_remove", 0), fake, config(tools), fake.clock())
    assert refused.value.reason == "not_supported"


def test_the_sim_daemons_busy_gpus_are_refused(node: SimNode, tools: Tools) -> None:
    """Every sim GPU runs a (non-trainer) process, so neither a reset nor an XID may touch it."""
    for kind in ("reset_gpu", "pcie_remove", "xid_fault"):
        with pytest.raises(DrillRefused) as refused:
            prepare(Request(kind, 2), ClientApi(node), config(tools), sim_clock(node))
        assert refused.value.reason == "target_busy"
    assert node.gpu(2)["quarantined"] is False


def _trainer_gpu(**changes: Any) -> dict[str, Any]:
    trainer = {"pid": 4242, "rank": 1, "local_rank": 1, "job_id": "job-7", "updated_t": 999.0}
    return fake_gpu(0, trainers=[trainer], sample={"t": 0.0, "pids": [4242]}, **changes)


METRICS = """# TYPE gpuwatch_gpu_finding gauge
gpuwatch_gpu_finding{gpu="0",uuid="GPU-fake-0",rule="xid_critical",severity="unhealthy",action="reboot",drill="true"} 1
# TYPE gpuwatch_gpu_health_state gauge
gpuwatch_gpu_health_state{gpu="0",uuid="GPU-fake-0",state="unhealthy",drill="true"} 1
"""


def _remediation(ended: str = "exited", resumes: bool = True) -> Any:
    """The fake daemon's side of an XID 79: finding, quarantine, then the incident as remediation writes it."""

    def react(daemon: FakeDaemon) -> None:
        gpu = daemon.gpu(0)
        if daemon.posts and daemon.posts[-1][0] == "/v1/gpus/0/inject" and not gpu["quarantined"]:
            finding = {"rule": "xid_critical", "severity": "unhealthy", "action": "reboot", "reason": "XID 79"}
            gpu.update(state="unhealthy", quarantined=True, findings=[{**finding, "drill": True}])
            daemon.metrics = METRICS
            daemon.incidents.append(
                {"id": 1, "t": daemon.t, "gpu": 0, "uuid": "GPU-fake-0", "cause": "unhealthy: xid_critical",
                 "job": "job-7", "stop_signal": "SIGUSR1", "status": "stopping", "ranks": [],
                 "time_to_stop_s": None, "time_to_resume_s": None, "steps_lost": None}
            )  # fmt: skip
        incident = daemon.incidents[0] if daemon.incidents else None
        if incident and daemon.t - incident["t"] >= 8 and incident["time_to_stop_s"] is None:
            rank = {"pid": 4242, "rank": 1, "gpu": 0, "job": "job-7", "ended": ended}
            incident.update(status="stopped", time_to_stop_s=8.0, ranks=[rank])
        if incident and daemon.t - incident["t"] >= 40 and incident["status"] == "stopped":
            incident.update(status="resumed", time_to_resume_s=40.0, steps_lost=3) if resumes else incident.update(
                status="not_resumed"
            )

    return react


def _inject(fake: FakeDaemon, tools: Tools) -> Verdict:
    return run_drill(prepare(Request("inject", None, "gpu=0,preset=xid79"), fake, config(tools), fake.clock()))


def test_trainer_chain_passes_when_ranks_checkpoint_and_the_job_resumes(tools: Tools) -> None:
    fake = FakeDaemon([_trainer_gpu()])
    fake.react = _remediation()
    verdict = _inject(fake, tools)
    assert verdict.result == "pass", verdict.as_dict()
    steps = {s.name: s for s in verdict.steps}
    assert steps["trainer_stop_requested"].detail.startswith("incident for job job-7")
    assert steps["checkpoint_written"].detail == (
        "the ranks checkpointed and exited on SIGUSR1, 8.0 s after the quarantine"
    )
    assert steps["job_resumed"].detail == "the job resumed 40.0 s after the quarantine, 3 step(s) lost"


def test_a_rank_that_had_to_be_killed_wrote_no_checkpoint(tools: Tools) -> None:
    fake = FakeDaemon([_trainer_gpu()])
    fake.react = _remediation(ended="SIGKILL")
    verdict = _inject(fake, tools)
    assert verdict.broke_at == "checkpoint_written"
    failed = next(s for s in verdict.steps if s.name == "checkpoint_written")
    assert failed.detail == "not every rank left on SIGUSR1 with a checkpoint: stopped rank 1 by SIGKILL"


def test_a_job_that_never_resumes_fails_the_drill(tools: Tools) -> None:
    fake = FakeDaemon([_trainer_gpu()])
    fake.react = _remediation(resumes=False)
    verdict = _inject(fake, tools)
    assert verdict.broke_at == "job_resumed"
    assert "did not resume (incident status not_resumed, job job-7)" in verdict.steps[-2].detail


def test_no_incident_route_fails_the_stop_step_by_name(tools: Tools) -> None:
    fake = FakeDaemon([_trainer_gpu()])
    remediation = _remediation()

    def no_incidents(daemon: FakeDaemon) -> None:
        remediation(daemon)
        daemon.incidents.clear()

    fake.react = no_incidents
    verdict = _inject(fake, tools)
    assert verdict.broke_at == "trainer_stop_requested"
    assert "no incident for GPU 0 since the drill started" in verdict.steps[4].detail
