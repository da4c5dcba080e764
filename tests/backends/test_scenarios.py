"""Every sim scenario end to end: sim backend → monitor → rules → state machine → HTTP API and /metrics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuwatch.backends.sim import SCENARIOS
from gpuwatch.node.offline import check
from tests.helpers import metric_samples, sim_config, start_sim_node

RULE_SCENARIOS = sorted(name for name in SCENARIOS if name not in {"demo", "all_series", "healthy", "idle"})
# How long each fault needs before its rule can fire (windows, rates, repeats), in fake seconds.
RUN_S = {"ecc_correctable_rate": 600.0, "xid_app_repeated": 120.0, "power_unstable": 300.0}
WARNING_RULES = {"xid_app"}  # a warning finding never changes the GPU's state


@pytest.mark.parametrize("scenario", RULE_SCENARIOS)
def test_rule_scenario_flags_only_its_gpu(tmp_path: Path, scenario: str) -> None:
    node = start_sim_node(tmp_path, scenario, gpus=4)
    try:
        node.run_for(RUN_S.get(scenario, 150.0))
        faulty = node.gpu(1)
        assert scenario in {f["rule"] for f in faulty["findings"]}, faulty["findings"]
        assert faulty["state"] in ({"healthy"} if scenario in WARNING_RULES else {"degraded", "unhealthy"})
        for index in (0, 2, 3):
            gpu = node.gpu(index)
            assert gpu["state"] == "healthy", (index, gpu["findings"])
            assert [f for f in gpu["findings"] if f["severity"] in {"degraded", "unhealthy"}] == []
    finally:
        node.close()


def test_healthy_scenario_stays_healthy_for_an_hour(tmp_path: Path) -> None:
    node = start_sim_node(tmp_path, "healthy", gpus=8)
    try:
        for _ in range(12):
            node.run_for(300, step=30)
            states = {
                g["index"]: (g["state"], [f["rule"] for f in g["findings"]])
                for g in node.client.get("/v1/gpus").json()["gpus"]
            }
            assert all(state == "healthy" for state, _ in states.values()), states
    finally:
        node.close()


def test_demo_flags_both_faulty_gpus_within_two_minutes_at_5s(tmp_path: Path) -> None:
    node = start_sim_node(tmp_path, "demo", gpus=8)
    try:
        node.run_for(120, step=5)
        gpu3, gpu5 = node.gpu(3), node.gpu(5)
        assert gpu3["state"] == "degraded" and "clocks_hw_slowdown" in {f["rule"] for f in gpu3["findings"]}
        assert gpu5["state"] == "unhealthy" and "ecc_uncorrectable" in {f["rule"] for f in gpu5["findings"]}
        assert gpu5["quarantined"] is True
        others = [node.gpu(i)["state"] for i in (0, 1, 2, 4, 6, 7)]
        assert others == ["healthy"] * 6
        metrics = node.client.get("/metrics").text
        unhealthy = {
            labels["gpu"]
            for labels, value in metric_samples(metrics, "gpuwatch_gpu_health_state")
            if labels["state"] == "unhealthy" and value == 1
        }
        degraded = {
            labels["gpu"]
            for labels, value in metric_samples(metrics, "gpuwatch_gpu_health_state")
            if labels["state"] == "degraded" and value == 1
        }
        assert (unhealthy, degraded) == ({"5"}, {"3"})
        findings = {(labels["gpu"], labels["rule"]) for labels, _ in metric_samples(metrics, "gpuwatch_gpu_finding")}
        assert {("3", "clocks_hw_slowdown"), ("5", "ecc_uncorrectable")} <= findings
    finally:
        node.close()


@pytest.mark.parametrize("scenario", RULE_SCENARIOS)
def test_check_on_a_rule_scenario_shows_its_fault(tmp_path: Path, scenario: str) -> None:
    """`gpuwatch check --sim-scenario RULE` simulates the scenario up to its judged_by_s, at once."""
    started = time.monotonic()
    snapshot = check(sim_config(tmp_path, scenario, gpus=2))
    assert time.monotonic() - started < 20, "simulated time must not be waited for"
    faulty, other = snapshot.gpu(1), snapshot.gpu(0)
    assert faulty is not None and other is not None
    assert scenario in {f.rule for f in faulty.findings}, faulty.findings
    assert faulty.state.value in ({"healthy"} if scenario in WARNING_RULES else {"degraded", "unhealthy"})
    assert other.state.value == "healthy" and other.findings == ()
