"""Inject drills end to end against the sim daemon (fake clock): the chain passes when the daemon
reacts, fails loudly at the step where it does not, and verdicts are stored, exported and served."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuwatch.config import Config, DrillSchedule
from gpuwatch.drills.runner import DrillRefused, Request, prepare, run_drill
from gpuwatch.drills.steps import Clock, Step, Verdict, execute
from gpuwatch.errors import DrillError
from tests.drills.conftest import ClientApi, drill_service, sim_clock, start_drill_node
from tests.helpers import SimNode, metric_samples


def inject(node: SimNode, spec: str, config: Config | None = None, **request: object) -> Verdict:
    api = ClientApi(node)
    run = prepare(Request("inject", None, spec, **request), api, config or node.daemon.config, sim_clock(node))  # type: ignore[arg-type]
    return run_drill(run)


def results(verdict: Verdict) -> dict[str, str]:
    return {s.name: s.result for s in verdict.steps}


def test_xid79_drill_passes_the_whole_chain(node: SimNode) -> None:
    verdict = inject(node, "gpu=1,preset=xid79")
    assert verdict.result == "pass", verdict.as_dict()
    assert results(verdict) == {
        "inject": "pass",
        "finding": "pass",
        "alert_metric": "pass",
        "quarantined": "pass",
        "trainer_stop_requested": "skip",
        "checkpoint_written": "skip",
        "job_resumed": "skip",
        "released_after_burn_in": "skip",
    }
    steps = {s.name: s for s in verdict.steps}
    assert steps["finding"].duration_s == 0.0, "an event is judged at once"
    assert steps["finding"].detail.startswith("xid_critical (unhealthy, action reboot)")
    assert 'gpuwatch_gpu_health_state{gpu="1",drill="true",state="unhealthy"} 1' in steps["alert_metric"].detail
    assert steps["trainer_stop_requested"].detail == "no trainer on GPU 1"
    gpu = node.gpu(1)
    assert gpu["quarantined"] and gpu["findings"][0]["drill"] is True
    assert node.gpu(0)["findings"] == [], "only the target GPU is touched"


def test_low_clock_drill_waits_for_the_rule_window(node: SimNode) -> None:
    verdict = inject(node, "gpu=2,preset=clock_low,for=600")
    assert verdict.result == "pass", verdict.as_dict()
    steps = {s.name: s for s in verdict.steps}
    rules = node.daemon.config.rules
    assert rules.clock_window_s * rules.level_duty <= steps["finding"].duration_s <= rules.clock_window_s
    assert steps["finding"].detail.startswith("sm_clock_low_unexplained (degraded")
    assert steps["quarantined"].result == "skip"
    assert "quarantine_degraded_after_s = 900 s; this fault lasts 600 s" in steps["quarantined"].detail


def test_gpu_lost_drill_quarantines(node: SimNode) -> None:
    verdict = inject(node, "gpu=3,preset=gpu_lost,for=120")
    assert verdict.result == "pass", verdict.as_dict()
    assert results(verdict)["quarantined"] == "pass"
    assert node.gpu(3)["error"] == "gpu_lost"


def test_verdict_fails_at_the_finding_when_the_rule_is_disabled(tmp_path: Path) -> None:
    node = start_drill_node(tmp_path, **{"rules.disabled": "xid"})
    try:
        verdict = inject(node, "gpu=1,preset=xid79")
    finally:
        node.close()
    assert verdict.result == "fail" and verdict.broke_at == "finding"
    finding = next(s for s in verdict.steps if s.name == "finding")
    assert finding.detail == "not within 2 s: GPU 1 findings: none"
    assert finding.duration_s >= 2.0
    assert [s.result for s in verdict.steps[2:]] == ["not_run"] * 6
    assert verdict.as_dict()["broke_at"] == "finding"


def test_await_release_waits_for_the_daemons_burn_in(tmp_path: Path) -> None:
    node = start_drill_node(
        tmp_path, **{"rules.xid_window_s": 30.0, "policy.recovery_s": 10.0, "policy.burn_in_s": 60.0}
    )
    try:
        verdict = inject(node, "gpu=0,preset=xid79", await_release=True)
        assert verdict.result == "pass", verdict.as_dict()
        released = verdict.steps[-1]
        assert released.name == "released_after_burn_in" and released.result == "pass"
        assert (
            30.0 + 60.0 <= released.duration_s <= 30.0 + 10.0 + 60.0 + 15.0
        )  # window, then burn-in from the first clean judgement
        assert node.gpu(0)["quarantined"] is False
    finally:
        node.close()


@pytest.mark.parametrize(
    ("before", "spec", "reason"),
    [
        ("quarantine", "gpu=1,preset=xid79", "target_quarantined"),
        ("degrade", "gpu=1,preset=ecc_dbe", "target_unhealthy"),
        ("gpu=1,xid=31", "gpu=1,xid=31", "target_has_finding"),
        (None, "gpu=9,preset=xid79", "no_such_gpu"),
    ],
)
def test_guards_refuse_a_target_where_a_drill_proves_nothing(
    node: SimNode, before: str | None, spec: str, reason: str
) -> None:
    if before == "quarantine":
        node.client.post("/v1/gpus/1/quarantine", json={"reason": "bad fan"}, headers=node.auth)
    elif before == "degrade":
        body = {"fields": {"sm_clock_mhz": 500, "clocks_event_reasons": 0, "util_gpu_pct": 100}, "duration_s": 600}
        node.client.post("/v1/gpus/1/inject", json=body, headers=node.auth)
        node.run_for(60)
        assert node.gpu(1)["state"] == "degraded" and not node.gpu(1)["quarantined"]
    elif before:
        assert inject(node, before).steps[0].result == "pass"
    with pytest.raises(DrillRefused) as refused:
        prepare(Request("inject", None, spec), ClientApi(node), node.daemon.config, sim_clock(node))
    assert refused.value.reason == reason


def test_posted_verdicts_are_stored_exported_and_served(node: SimNode) -> None:
    passed = inject(node, "gpu=1,preset=xid79")
    assert node.client.post("/v1/drills", json=passed.as_dict(), headers=node.auth).status_code == 200
    body = node.client.get("/v1/drills").json()
    (run,) = body["runs"]
    assert run["drill"] == "inject" and run["result"] == "pass" and run["trigger"] == "cli" and run["gpu"] == 1
    assert [s["name"] for s in run["steps"]][:3] == ["inject", "finding", "alert_metric"]
    text = node.client.get("/metrics").text
    assert metric_samples(text, "gpuwatch_drill_last_run_timestamp_seconds") == [
        ({"drill": "inject", "result": "pass"}, passed.finished)
    ]
    steps = dict(
        (labels["step"], value) for labels, value in metric_samples(text, "gpuwatch_drill_step_duration_seconds")
    )
    assert set(steps) == {"inject", "finding", "alert_metric", "quarantined"}, "skipped steps are not timed"
    assert metric_samples(text, "gpuwatch_drill_runs_total") == [({"drill": "inject", "result": "pass"}, 1.0)]


@pytest.mark.slow
def test_verdicts_survive_a_restart_in_the_last_run_gauge(tmp_path: Path) -> None:
    first = start_drill_node(tmp_path)
    verdict = inject(first, "gpu=1,preset=xid79")
    first.client.post("/v1/drills", json=verdict.as_dict(), headers=first.auth)
    first.close()
    second = start_drill_node(tmp_path)
    try:
        text = second.client.get("/metrics").text
        assert metric_samples(text, "gpuwatch_drill_last_run_timestamp_seconds") == [
            ({"drill": "inject", "result": "pass"}, verdict.finished)
        ]
        assert metric_samples(text, "gpuwatch_drill_runs_total") == [], "counters count since the start"
    finally:
        second.close()


@pytest.mark.parametrize(
    "change",
    [{"result": "fail"}, {"broke_at": "finding"}, {"drill": "melt"}, {"extra": 1}, {"steps": []}],
)
def test_inconsistent_verdicts_are_422_and_not_stored(node: SimNode, change: dict[str, object]) -> None:
    body = {**inject(node, "gpu=1,preset=xid79").as_dict(), **change}
    assert node.client.post("/v1/drills", json=body, headers=node.auth).status_code == 422
    assert node.client.get("/v1/drills").json()["runs"] == []


def test_drill_posts_need_the_token(node: SimNode) -> None:
    body = inject(node, "gpu=1,preset=xid79").as_dict()
    assert node.client.post("/v1/drills", json=body).status_code == 401
    assert node.client.post("/v1/drills/window", json={"gpu": 0, "duration_s": 5}).status_code == 401
    assert node.client.post("/v1/backend/release", json={}).status_code == 401
    assert node.client.post("/v1/drills/run", json={"drill": "inject"}).status_code == 401


def test_window_marks_findings_as_a_drill_without_changing_readings(node: SimNode) -> None:
    response = node.client.post("/v1/drills/window", json={"gpu": 2, "duration_s": 60}, headers=node.auth)
    assert response.status_code == 200
    node.daemon.monitor.handle_events([])  # nothing yet
    node.run_for(5)
    assert node.gpu(2)["drill_active"] is True and node.gpu(2)["state"] == "healthy"
    assert node.client.post("/v1/drills/window", json={"gpu": 9, "duration_s": 5}, headers=node.auth).status_code == 404


def test_sim_backend_has_no_handles_to_release(node: SimNode) -> None:
    body = node.client.post("/v1/backend/release", json={}, headers=node.auth).json()
    assert body == {"released": False, "detail": "the sim backend holds no handles"}
    assert node.client.post("/v1/backend/reacquire", json={}, headers=node.auth).json()["reacquired"] is False


def test_a_new_verdict_invalidates_the_metrics_render_cache(node: SimNode) -> None:
    before = node.daemon.renderer.render()
    assert node.daemon.renderer.render() is before
    node.client.post("/v1/drills", json=inject(node, "gpu=1,preset=xid79").as_dict(), headers=node.auth)
    assert b"gpuwatch_drill_runs_total" in node.daemon.renderer.render()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_the_drill_metrics(tmp_path: Path) -> None:
    node = start_drill_node(tmp_path, schedule=(DrillSchedule(cron="0 15 * * fri", drill="xid_fault"),))
    try:
        empty = node.client.get("/metrics").text
        node.client.post("/v1/drills", json=inject(node, "gpu=1,preset=xid79").as_dict(), headers=node.auth)
        (entry,) = drill_service(node).drills.entries
        assert drill_service(node).drills.run(entry) is None  # every sim GPU is busy: a counted skip
        full = node.client.get("/metrics").text
    finally:
        node.close()
    assert "gpuwatch_drill_skipped_total{" in full
    for text in (empty, full):
        done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def test_a_failed_step_is_logged_as_text_not_as_a_repr(caplog: pytest.LogCaptureFixture) -> None:
    """Without logging configured, Python prints warnings as they are: a `StepResult(...)` repr reached the terminal."""

    def broken() -> str:
        raise DrillError("no token")

    with caplog.at_level(logging.INFO, logger="gpuwatch.drills"):
        execute([Step("inject", "inject it", broken)], Clock(lambda: 5.0, lambda _s: None, 0.1))
    assert [r.getMessage() for r in caplog.records] == ["drill step inject: fail in 0.00 s: no token"]
