"""A node that shows fewer GPUs than `expected_gpus` fails: `gpu_missing` on the node, in check, the API,
the status page, the metrics the alert watches, and Slurm's drain (HealthCheckProgram and daemon alike)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.cluster.slurm import Drainer, Scontrol, Want, wanted
from gpuwatch.config import RulesConfig, SlurmConfig
from gpuwatch.health import node
from gpuwatch.testing.daemon_process import free_port, run_gpuwatch
from tests.cluster.test_slurm import view
from tests.helpers import fake_scontrol, metric_value, start_sim_node

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "systemd" / "gpuwatch.toml"


def test_the_rule_is_the_count_the_alert_compares() -> None:
    rules = RulesConfig()
    (found,) = node.judge(4, 8, 5.0, rules)
    assert (found.rule, found.severity.value, found.action.value) == ("gpu_missing", "unhealthy", "reboot")
    assert found.t == 5.0
    assert "4 of the 8 GPUs" in found.reason
    assert node.judge(8, 8, 5.0, rules) == node.judge(9, 8, 5.0, rules) == ()


def test_check_with_the_shipped_config_on_4_of_8_gpus_exits_1_naming_it(tmp_path: Path) -> None:
    """The shipped config says 8 GPUs: a node that shows 4 is not healthy, though each of the 4 is."""
    args = ["check", "--config", str(SHIPPED_CONFIG), "--backend", "sim", "--sim-scenario", "healthy"]
    done = run_gpuwatch(*args, "--sim-gpus", "4", "--samples", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5 and all(line.endswith("healthy: no findings") for line in lines[:4]), done.stdout
    assert lines[4].startswith("node unhealthy: gpu_missing: 4 of the 8 GPUs this node should have"), done.stdout
    full = run_gpuwatch(*args, "--sim-gpus", "8", "--samples", "1")
    assert full.returncode == 0 and "gpu_missing" not in full.stdout, full.stdout


@pytest.mark.slow
def test_the_daemon_reports_it_on_the_node_consistently_with_the_alerts_series(tmp_path: Path) -> None:
    sim = start_sim_node(tmp_path, "healthy", gpus=4, expected_gpus=8)
    try:
        listed = sim.client.get("/v1/gpus").json()
        assert [f["rule"] for f in listed["node_findings"]] == ["gpu_missing"]
        assert listed["node_findings"][0]["severity"] == "unhealthy" and listed["node_findings"][0]["gpu"] == -1
        assert all(g["state"] == "healthy" for g in listed["gpus"])  # no GPU is to blame
        metrics = sim.client.get("/metrics").text
        assert metric_value(metrics, "gpuwatch_gpus") < metric_value(metrics, "gpuwatch_gpus_expected")
        page = sim.client.get("/").text
        assert 'data-rule="gpu_missing"' in page and "4 of the 8 GPUs" in page
    finally:
        sim.close()
    (tmp_path / "whole").mkdir()
    whole = start_sim_node(tmp_path / "whole", "healthy", gpus=4, expected_gpus=4)
    try:
        assert whole.client.get("/v1/gpus").json()["node_findings"] == []
        metrics = whole.client.get("/metrics").text
        assert metric_value(metrics, "gpuwatch_gpus") == metric_value(metrics, "gpuwatch_gpus_expected")
    finally:
        whole.close()


def test_disabling_the_rule_silences_it() -> None:
    rules = RulesConfig(disabled=("gpu_missing",))
    assert node.judge(4, 8, 0.0, rules) == ()


@pytest.mark.parametrize("drain_on", ["unhealthy", "any_quarantine"])
def test_a_missing_gpu_drains_under_the_quarantine_policies(drain_on: str) -> None:
    policy = SlurmConfig(drain_on=drain_on)
    got = wanted([view(0), view(1)], policy, ["gpu_missing: 2 of the 8 GPUs\n are visible"])
    assert got == Want("drain", "gpuwatch: gpu_missing: 2 of the 8 GPUs? are visible")


def test_usable_below_counts_the_missing_gpus_as_not_usable() -> None:
    policy = SlurmConfig(drain_on="usable_below", min_usable_gpus=2)
    assert wanted([view(0), view(1)], policy, ["gpu_missing: 2 of 8"]) == Want("resume")
    assert wanted([view(0)], policy, ["gpu_missing: 1 of 8"]).action == "drain"


def test_check_slurm_as_healthcheckprogram_drains_a_node_missing_a_gpu(tmp_path: Path) -> None:
    """No daemon answers (the commonest case at boot): check samples, finds the GPU missing and drains."""
    program, node_file = fake_scontrol(tmp_path)
    args = ["check", "--slurm", "--config", str(SHIPPED_CONFIG), "--backend", "sim", "--sim-scenario", "healthy"]
    args += ["--sim-gpus", "7", "--samples", "1", "--listen", f"127.0.0.1:{free_port()}", "--state-dir", str(tmp_path)]
    done = run_gpuwatch(*args, env={"GPUWATCH_SLURM_SCONTROL": program, "GPUWATCH_SLURM_NODE_NAME": "n"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "slurm: node n drained" in done.stdout
    assert "Reason=gpuwatch: gpu_missing: 7 of the 8 GPUs" in node_file.read_text()


def test_the_daemons_drainer_drains_for_it(tmp_path: Path) -> None:
    program, node_file = fake_scontrol(tmp_path)
    sim = start_sim_node(tmp_path, "healthy", gpus=2, expected_gpus=3)
    try:
        drainer = Drainer(SlurmConfig(enabled=True, node_name="n", scontrol=program), scontrol=Scontrol(program, 10))
        drainer.on_publish(sim.daemon.monitor.snapshot, [])
        drainer.step()
        assert "Reason=gpuwatch: gpu_missing: 2 of the 3 GPUs" in node_file.read_text()
    finally:
        sim.close()
