"""Hostile API bodies and queries: 422 naming what is wrong, never a 500, and nothing changed (issue 10 items 6, 7)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SimNode, start_sim_node


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    sim = start_sim_node(tmp_path, gpus=2)
    yield sim
    sim.close()


def post_raw(node: SimNode, path: str, body: str) -> tuple[int, str]:
    headers = {**node.auth, "content-type": "application/json"}
    response = node.client.post(path, content=body.encode("utf-8", "surrogatepass"), headers=headers)
    return response.status_code, response.text


@pytest.mark.parametrize("gpu", ["100000000000000000000", "-1", "99999999999"])
def test_findings_with_a_huge_gpu_index_is_422(node: SimNode, gpu: str) -> None:
    response = node.client.get("/v1/findings", params={"gpu": gpu})
    assert response.status_code == 422 and "gpu" in response.text


def test_findings_limit_out_of_range_is_422(node: SimNode) -> None:
    assert node.client.get("/v1/findings", params={"limit": str(10**30)}).status_code == 422
    assert node.client.get("/v1/findings", params={"limit": "5"}).status_code == 200


@pytest.mark.parametrize(
    "reason",
    [r'"\ud800"', r'"ok \udfff then"', r'"two\nlines"', r'"esc \u001b[31m"'],
)
def test_a_reason_that_is_not_one_printable_line_is_422(node: SimNode, reason: str) -> None:
    status, text = post_raw(node, "/v1/gpus/0/quarantine", f'{{"reason": {reason}}}')
    assert status == 422 and "reason" in text
    assert node.gpu(0)["quarantined"] is False
    status, _ = post_raw(node, "/v1/gpus/0/release", f'{{"reason": {reason}}}')
    assert status == 422


@pytest.mark.parametrize("duration", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_duration_that_is_not_finite_is_422(node: SimNode, duration: str) -> None:
    status, text = post_raw(node, "/v1/gpus/0/inject", f'{{"fields": {{"power_w": 100}}, "duration_s": {duration}}}')
    assert status == 422 and "duration_s" in text
    assert node.client.get("/v1/injections").json()["injections"] == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ('{"ecc_sbe_volatile": "x"}', "ecc_sbe_volatile"),
        ('{"sm_clock_mhz": "abc"}', "sm_clock_mhz"),
        ('{"sm_clock_mhz": 1.5}', "sm_clock_mhz"),
        ('{"sm_clock_mhz": -1}', "sm_clock_mhz"),
        ('{"sm_clock_mhz": true}', "sm_clock_mhz"),
        ('{"power_w": -5}', "power_w"),
        ('{"power_w": 1e400}', "power_w"),
        ('{"temp_c": 100000000000000000000000}', "temp_c"),
        ('{"ecc_sbe_volatile": 1' + "0" * 400 + "}", "ecc_sbe_volatile"),
        ('{"\\ud800": 1}', "ud800"),
        ('{"error": "\\udfff"}', "udfff"),
        ('{"sm_clock_mhz": "' + "x" * 10000 + '"}', "sm_clock_mhz"),
        ('{"util_gpu_pct": 150}', "util_gpu_pct"),
        ('{"error": "on_fire"}', "error"),
        ('{"error": 3}', "error"),
        ('{"pids": ["a"]}', "pids"),
        ('{"t": 5}', "t"),
        ('{"nonsense": 1}', "nonsense"),
    ],
)
def test_a_wrong_injection_is_422_naming_the_field_and_changes_nothing(node: SimNode, fields: str, named: str) -> None:
    status, text = post_raw(node, "/v1/gpus/1/inject", f'{{"fields": {fields}, "duration_s": 3}}')
    assert status == 422 and named in text, text
    assert node.client.get("/v1/injections").json()["injections"] == []
    node.run_for(10)
    after = [node.gpu(i) for i in (0, 1)]
    assert all(g["sample"] is not None and g["error"] is None for g in after), "sampling goes on for every GPU"
    assert after[1]["drill_active"] is False


def test_valid_injection_keeps_types(node: SimNode) -> None:
    status, text = post_raw(
        node, "/v1/gpus/1/inject", '{"fields": {"sm_clock_mhz": 500.0, "power_w": 100}, "duration_s": 30}'
    )
    assert status == 200, text
    node.run_for(5)
    sample = node.gpu(1)["sample"]
    assert sample["sm_clock_mhz"] == 500 and isinstance(sample["sm_clock_mhz"], int)
    assert sample["power_w"] == 100.0 and isinstance(sample["power_w"], float)
    assert node.gpu(0)["sample"]["sm_clock_mhz"] != 500


def test_openapi_is_served_only_when_configured(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    closed = start_sim_node(tmp_path / "a", gpus=1)
    opened = start_sim_node(tmp_path / "b", gpus=1, **{"api.docs": True})
    try:
        assert closed.client.get("/openapi.json").status_code == 404
        assert opened.client.get("/openapi.json").json()["info"]["title"] == "gpuwatch"
    finally:
        closed.close()
        opened.close()


def test_rules_failing_on_one_gpu_never_stop_judging_the_others(
    node: SimNode, caplog: pytest.LogCaptureFixture
) -> None:
    """Defence behind the validation: a value the rules choke on (here planted past the API) stays on its GPU."""
    from gpuwatch.node.injection import Injection

    monitor = node.daemon.monitor
    now = node.clock()
    monitor._injections[1] = Injection(99, 1, {"sm_clock_mhz": "abc", "util_gpu_pct": "x"}, now, now + 60)
    node.run_for(10)
    assert "GPU 1: rules failed" in caplog.text
    snapshot = monitor.snapshot
    assert snapshot.t == node.clock(), "ticks went on"
    assert snapshot.gpu(0).sample is not None and snapshot.gpu(0).sample.t == node.clock()
    assert snapshot.gpu(0).state.value == "healthy"
