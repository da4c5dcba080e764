"""gpuwatch/cluster/slurm.py without Slurm: the policy, the plan, reading scontrol, failures, the drainer, its metrics.

The real slurmctld and slurmd run in tests/e2e/test_slurm_drain.py; here scontrol is a shell
script where its failures (missing, an error, a hang) are the point, and an in-memory node elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from gpuwatch.cli import main
from gpuwatch.cluster.slurm import (
    Drainer,
    DrainStatus,
    GpuView,
    Scontrol,
    SlurmCollector,
    SlurmError,
    SlurmNode,
    Want,
    parse_show_node,
    plan,
    wanted,
)
from gpuwatch.config import SlurmConfig
from gpuwatch.testing.daemon_process import free_port
from tests.helpers import fake_scontrol, metric_samples, start_sim_node

SHOW_DRAINED = """NodeName=gwnode Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=0.41
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug
   Reason=gpuwatch: GPU 2 GPU-abc quarantined: bad fan [root@2026-11-30T21:06:35]
"""


def view(index: int, state: str = "healthy", quarantined: bool = False, cause: str = "") -> GpuView:
    return GpuView(index, f"GPU-{index}", state, quarantined, cause or "quarantined: x")


def test_unhealthy_policy_drains_for_a_gpu_quarantined_as_unhealthy_only() -> None:
    policy = SlurmConfig()
    assert wanted([view(0), view(1, "healthy", True)], policy) == Want("hold")  # quarantined, not unhealthy
    assert wanted([view(0, "unhealthy"), view(1)], policy) == Want("resume")  # unhealthy, not quarantined (yet)
    got = wanted([view(0), view(3, "unhealthy", True, "ecc_uncorrectable")], policy)
    assert got == Want("drain", "gpuwatch: GPU 3 GPU-3 ecc_uncorrectable")


def test_any_quarantine_names_the_first_and_counts_the_rest() -> None:
    policy = SlurmConfig(drain_on="any_quarantine")
    got = wanted([view(0), view(1, quarantined=True), view(2, "unhealthy", True, "xid_critical")], policy)
    assert got == Want("drain", "gpuwatch: GPU 1 GPU-1 quarantined: x (+1 more GPU(s))")
    assert wanted([view(0), view(1)], policy) == Want("resume")


def test_usable_below() -> None:
    policy = SlurmConfig(drain_on="usable_below", min_usable_gpus=3)
    gpus = [view(0), view(1), view(2, quarantined=True), view(3)]
    assert wanted(gpus, policy) == Want("hold")  # 3 usable
    gpus[0] = view(0, "unhealthy")
    assert wanted(gpus, policy) == Want(
        "drain", "gpuwatch: GPU 0 GPU-0 quarantined: x (+1 more GPU(s)); 2 usable, fewer than 3"
    )


def test_the_reason_is_one_printable_line_of_bounded_length() -> None:
    reason = wanted([view(0, "unhealthy", True, "quarantined: " + "x\n\x1b" * 300)], SlurmConfig()).reason
    assert reason.startswith("gpuwatch: GPU 0 GPU-0 quarantined: x??x") and len(reason) == 200


def test_parse_show_node() -> None:
    node = parse_show_node("gwnode", SHOW_DRAINED)
    assert node == SlurmNode("gwnode", "IDLE+DRAIN", "gpuwatch: GPU 2 GPU-abc quarantined: bad fan")
    assert node.drained and node.ours
    idle = parse_show_node("gwnode", "NodeName=gwnode\n   State=IDLE ThreadsPerCore=1\n")
    assert idle == SlurmNode("gwnode", "IDLE", "") and not idle.drained
    assert parse_show_node("n", "   State=DRAINED\n   Reason=maintenance [ops@2026]\n").reason == "maintenance"
    with pytest.raises(SlurmError, match="no State="):
        parse_show_node("gwnode", "Node gwnode not found")


@pytest.mark.parametrize(
    ("want", "node", "expected"),
    [
        (Want("drain", "gpuwatch: x"), SlurmNode("n", "IDLE", ""), "drain"),
        (Want("drain", "gpuwatch: x"), SlurmNode("n", "MIXED+DRAIN", "gpuwatch: y"), None),  # already, once
        (Want("drain", "gpuwatch: x"), SlurmNode("n", "DRAINED", "maintenance"), None),  # never overwritten
        (Want("resume"), SlurmNode("n", "IDLE+DRAIN", "gpuwatch: y"), "resume"),
        (Want("resume"), SlurmNode("n", "DRAINING", "maintenance"), None),  # never resumed
        (Want("resume"), SlurmNode("n", "IDLE", ""), None),
        (Want("hold"), SlurmNode("n", "IDLE+DRAIN", "gpuwatch: y"), None),
    ],
)
def test_plan(want: Want, node: SlurmNode, expected: str | None) -> None:
    assert plan(want, node) == expected


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "scontrol"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_scontrol_failures_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(SlurmError, match=r"^scontrol-x show node: .*scontrol-x not found \(slurm.scontrol\)$"):
        Scontrol("scontrol-x", 1).show("n")
    failing = script(tmp_path, 'echo "slurm_update error: Invalid node name specified" >&2; exit 1')
    with pytest.raises(SlurmError, match=r"update NodeName=n: exit 1: slurm_update error: Invalid node name"):
        Scontrol(failing, 1).resume("n")
    with pytest.raises(SlurmError, match=r"no answer within 0.2 s \(slurm.timeout_s\)$"):
        Scontrol(script(tmp_path, "exec sleep 10"), 0.2).show("n")


def test_scontrol_passes_the_reason_as_one_argument(tmp_path: Path) -> None:
    args = tmp_path / "args"
    Scontrol(script(tmp_path, f'printf "%s\\n" "$@" > {args}'), 1).drain("n", "gpuwatch: GPU 1 $(x) 'q'")
    assert args.read_text().splitlines() == ["update", "NodeName=n", "State=DRAIN", "Reason=gpuwatch: GPU 1 $(x) 'q'"]


class FakeScontrol(Scontrol):
    """An in-memory node: what Slurm would answer, and every update made."""

    def __init__(self, state: str = "IDLE", reason: str = "") -> None:
        super().__init__("scontrol", 1)
        self.node = SlurmNode("gwnode", state, reason)
        self.calls: list[str] = []
        self.fail = False

    def show(self, name: str) -> SlurmNode:
        if self.fail:
            raise SlurmError("scontrol show node: exit 1: slurmctld down")
        return self.node

    def drain(self, name: str, reason: str) -> None:
        self.calls.append(f"drain {reason}")
        self.node = SlurmNode(name, "IDLE+DRAIN", reason)

    def resume(self, name: str) -> None:
        self.calls.append("resume")
        self.node = SlurmNode(name, "IDLE", "")


def drainer(fake: FakeScontrol, gate: str | None = None) -> Drainer:
    return Drainer(SlurmConfig(node_name="gwnode", drain_on="any_quarantine"), fake, gate=lambda: gate)


def set_want(d: Drainer, want: Want) -> None:
    d._want = want  # what on_publish records from a Snapshot


def test_drainer_drains_once_resumes_and_counts() -> None:
    fake = FakeScontrol()
    d = drainer(fake)
    set_want(d, Want("drain", "gpuwatch: GPU 1 GPU-1 x"))
    d.step()
    d.step()
    assert fake.calls == ["drain gpuwatch: GPU 1 GPU-1 x"]
    assert d.status() == DrainStatus(drained=True, drains_total=1)
    set_want(d, Want("resume"))
    d.step()
    assert fake.calls[-1] == "resume" and d.status() == DrainStatus(drains_total=1, resumes_total=1)


def test_an_operators_resume_of_gpuwatchs_drain_is_respected_until_the_cause_changes() -> None:
    fake = FakeScontrol()
    d = drainer(fake)
    set_want(d, Want("drain", "gpuwatch: GPU 1 GPU-1 x"))
    d.step()
    fake.node = SlurmNode("gwnode", "IDLE", "")  # `scontrol update State=RESUME` by an operator
    d.step()
    assert fake.calls == ["drain gpuwatch: GPU 1 GPU-1 x"]
    set_want(d, Want("drain", "gpuwatch: GPU 1 GPU-1 x (+1 more GPU(s))"))
    d.step()
    assert fake.calls[-1] == "drain gpuwatch: GPU 1 GPU-1 x (+1 more GPU(s))"


def test_a_drain_by_someone_else_is_left_alone_and_reported() -> None:
    fake = FakeScontrol("DRAINED", "maintenance")
    d = drainer(fake)
    for want in (Want("drain", "gpuwatch: GPU 1 GPU-1 x"), Want("resume")):
        set_want(d, want)
        d.step()
    assert fake.calls == [] and d.status() == DrainStatus(drained_by_other=True)


def test_the_fleet_breaker_can_refuse_a_drain_but_not_a_resume() -> None:
    fake = FakeScontrol()
    d = drainer(fake, gate="12 node(s) drained")
    set_want(d, Want("drain", "gpuwatch: GPU 1 GPU-1 x"))
    d.step()
    assert fake.calls == [] and d.status() == DrainStatus(refused=True)
    fake.node = SlurmNode("gwnode", "IDLE+DRAIN", "gpuwatch: from before a restart")
    set_want(d, Want("resume"))
    d.step()
    assert fake.calls == ["resume"]


def test_failures_are_counted_and_clear_on_success() -> None:
    fake = FakeScontrol()
    d = drainer(fake)
    fake.fail = True
    for _ in range(2):
        with pytest.raises(SlurmError):
            d.step()
    assert d.status() == DrainStatus(failing=True, failures_total=2)
    fake.fail = False
    d.step()
    assert d.status() == DrainStatus(failures_total=2)


def test_collector_exports_exact_values_on_a_fresh_registry() -> None:
    status = DrainStatus(wanted=True, drained=True, failing=True, failures_total=3, drains_total=2, resumes_total=1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SlurmCollector(lambda: status))
    values = {
        name: registry.get_sample_value(name)
        for name in (
            "gpuwatch_slurm_drain_wanted",
            "gpuwatch_slurm_drained",
            "gpuwatch_slurm_drained_by_other",
            "gpuwatch_slurm_drain_refused",
            "gpuwatch_slurm_scontrol_failing",
            "gpuwatch_slurm_scontrol_failures_total",
            "gpuwatch_slurm_drains_total",
            "gpuwatch_slurm_resumes_total",
        )
    }
    assert values == {
        "gpuwatch_slurm_drain_wanted": 1.0,
        "gpuwatch_slurm_drained": 1.0,
        "gpuwatch_slurm_drained_by_other": 0.0,
        "gpuwatch_slurm_drain_refused": 0.0,
        "gpuwatch_slurm_scontrol_failing": 1.0,
        "gpuwatch_slurm_scontrol_failures_total": 3.0,
        "gpuwatch_slurm_drains_total": 2.0,
        "gpuwatch_slurm_resumes_total": 1.0,
    }


def test_gpu_view_from_the_api_takes_the_worst_finding() -> None:
    gpu = {
        "index": 3, "uuid": "GPU-3", "state": "unhealthy", "quarantined": True, "quarantine_reason": "unhealthy: …",
        "findings": [{"rule": "thermal_margin_low", "severity": "degraded"},
                     {"rule": "ecc_dbe", "severity": "unhealthy"}],
    }  # fmt: skip
    assert GpuView.from_api(gpu) == GpuView(3, "GPU-3", "unhealthy", True, "ecc_dbe")
    assert GpuView.from_api({**gpu, "findings": []}).cause == "quarantined: unhealthy: …"


def test_the_daemon_wires_the_drainer_to_its_snapshots_and_metrics(tmp_path: Path) -> None:
    program, node_file = fake_scontrol(tmp_path)
    overrides = {"slurm.enabled": True, "slurm.scontrol": program, "slurm.drain_on": "any_quarantine"}
    node = start_sim_node(tmp_path, gpus=2, **overrides)
    try:
        drainer = node.daemon.drainer
        assert drainer is not None
        uuid = node.gpu(1)["uuid"]
        response = node.client.post("/v1/gpus/1/quarantine", json={"reason": "fan"}, headers=node.auth)
        assert response.status_code == 200, response.text
        drainer.step()
        assert f"Reason=gpuwatch: GPU 1 {uuid} quarantined: fan [root@now]" in node_file.read_text()
        metrics = node.client.get("/metrics").text
        assert metric_samples(metrics, "gpuwatch_slurm_drained") == [({}, 1.0)]
        assert metric_samples(metrics, "gpuwatch_slurm_drains_total") == [({}, 1.0)]
        node.client.post("/v1/gpus/1/release", json={}, headers=node.auth)
        drainer.step()
        assert not node_file.exists()
        assert metric_samples(node.client.get("/metrics").text, "gpuwatch_slurm_resumes_total") == [({}, 1.0)]
    finally:
        node.close()


def test_check_slurm_without_a_daemon_samples_itself_and_never_resumes(tmp_path: Path) -> None:
    node_file = tmp_path / "node"
    node_file.write_text("NodeName=n\n   State=IDLE+DRAIN\n   Reason=gpuwatch: GPU 1 GPU-1 fan [root@now]\n")
    updates = tmp_path / "updates"
    program = script(
        tmp_path, f'[ "$1" = show ] && cat {node_file}; [ "$1" = update ] && echo "$@" >> {updates}; exit 0'
    )
    (tmp_path / "empty.toml").write_text("")
    result = CliRunner().invoke(
        main,
        ["check", "--slurm", "--backend", "sim", "--sim-scenario", "healthy", "--sim-gpus", "2", "--samples", "1",
         "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path)],
        env={"GPUWATCH_CONFIG": str(tmp_path / "empty.toml"), "GPUWATCH_SLURM_SCONTROL": program,
             "GPUWATCH_SLURM_NODE_NAME": "n"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "cannot reach the gpuwatch daemon" in result.stderr and "sampling the GPUs itself" in result.stderr
    assert "slurm: node n unchanged (state IDLE+DRAIN, reason 'gpuwatch: GPU 1 GPU-1 fan')" in result.stdout
    assert not updates.exists()
