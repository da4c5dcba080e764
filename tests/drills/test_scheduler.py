"""Scheduled drills: validated entries, next run times from the cron string, APScheduler jobs that never
replay missed runs in a burst, guards that skip and count, and runs driven by the fake clock."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger

from gpuwatch.config import Config, DrillSchedule, DrillsConfig
from gpuwatch.drills.record import DrillRecord
from gpuwatch.drills.runner import DrillRefused
from gpuwatch.drills.scheduler import DrillScheduler, entries, next_runs, pick_target
from gpuwatch.drills.steps import Clock
from gpuwatch.errors import ConfigError
from gpuwatch.node.store import Store
from gpuwatch.serving.wire import Gpu
from tests.drills.conftest import FakeDaemon, drill_service, fake_gpu, start_drill_node
from tests.helpers import metric_samples

FRIDAY_15 = DrillSchedule(cron="0 15 * * fri", drill="inject", gpu="1", args="preset=xid79")


def config_with(*schedule: DrillSchedule) -> Config:
    return Config(drills=DrillsConfig(schedule=schedule))


def test_next_runs_come_from_the_cron_string_in_utc() -> None:
    (entry,) = entries(config_with(FRIDAY_15))
    tuesday = datetime(2026, 12, 1, 9, 30, tzinfo=timezone.utc)
    assert [t.isoformat() for t in next_runs(entry, tuesday)] == [
        "2026-12-04T15:00:00+00:00",
        "2026-12-11T15:00:00+00:00",
        "2026-12-18T15:00:00+00:00",
    ]


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        (DrillSchedule(cron="0 15 * *", drill="inject", args="preset=xid79"), "drills.schedule[0]: cron '0 15 * *'"),
        (DrillSchedule(cron="0 15 * * fri", drill="melt"), "drill 'melt' is not one of"),
        (DrillSchedule(cron="0 15 * * fri", drill="reset_gpu"), "reset_gpu touches the card; set allow_destructive"),
        (DrillSchedule(cron="0 15 * * fri", drill="pcie_remove", gpu="0"), "pcie_remove touches the card"),
        (DrillSchedule(cron="0 15 * * fri", drill="kill_rank"), "kill_rank needs a GPU with a trainer"),
        (DrillSchedule(cron="0 15 * * fri", drill="inject", gpu="any", args="preset=xid79"), "gpu 'any' is not"),
        (DrillSchedule(cron="0 15 * * fri", drill="inject", args="gpu=1,preset=xid79"), "args: gpu=1: the schedule"),
        (DrillSchedule(cron="0 15 * * fri", drill="inject", args="preset=nope"), "args: preset=nope: unknown"),
        (DrillSchedule(cron="0 15 * * fri", drill="xid_fault", args="x=1"), "args: xid_fault takes none"),
        (
            DrillSchedule(cron="0 15 * * fri", drill="inject", args="preset=xid79", require_healthy_share=1.5),
            "require_healthy_share 1.5 is not in [0, 1]",
        ),
    ],
)
def test_bad_entries_are_one_config_error_naming_the_entry(entry: DrillSchedule, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        entries(config_with(entry))
    assert str(caught.value).startswith("drills.schedule[0]: ") and fragment in str(caught.value), caught.value


def test_destructive_drills_schedule_only_when_allowed() -> None:
    allowed = DrillSchedule(cron="30 3 1 * *", drill="reset_gpu", gpu="idle", allow_destructive=True)
    assert [e.schedule.drill for e in entries(config_with(FRIDAY_15, allowed))] == ["inject", "reset_gpu"]


def test_jobs_coalesce_missed_runs_and_drop_late_ones(tmp_path: Path) -> None:
    config = config_with(FRIDAY_15)
    clock = Clock(lambda: 0.0, lambda seconds: None, 1.0)
    drills = DrillScheduler(config, lambda: FakeDaemon([]), DrillRecord(Store(tmp_path / "db")), clock)
    node_scheduler = BackgroundScheduler(timezone="UTC")
    drills.add_jobs(node_scheduler)
    node_scheduler.start(paused=True)
    try:
        (job,) = node_scheduler.get_jobs()
        assert job.id == "drill-0" and job.coalesce is True and job.max_instances == 1
        assert job.misfire_grace_time == config.drills.misfire_grace_s == 300
        assert isinstance(job.trigger, CronTrigger) and str(job.trigger.timezone) == "UTC"
        assert job.next_run_time.weekday() == 4 and (job.next_run_time.hour, job.next_run_time.minute) == (15, 0)
    finally:
        node_scheduler.shutdown(wait=False)


def test_a_scheduled_run_at_its_fire_time_passes_and_is_recorded(tmp_path: Path) -> None:
    node = start_drill_node(tmp_path, schedule=(FRIDAY_15,))
    try:
        service = drill_service(node)
        (entry,) = service.drills.entries
        fire = next_runs(entry, datetime.fromtimestamp(node.clock.t, tz=timezone.utc))[0]
        node.clock.t = fire.timestamp()
        node.run_for(5)
        verdict = service.drills.run(entry)
        assert verdict is not None and verdict.result == "pass", verdict
        assert verdict.trigger == "schedule" and verdict.gpu == 1
        (stored,) = node.client.get("/v1/drills").json()["runs"]
        assert stored["trigger"] == "schedule" and stored["result"] == "pass"
        text = node.client.get("/metrics").text
        assert metric_samples(text, "gpuwatch_drill_runs_total") == [({"drill": "inject", "result": "pass"}, 1.0)]
        (view,) = node.client.get("/v1/drills").json()["schedule"]
        assert view["cron"] == "0 15 * * fri" and len(view["next_runs"]) == 3
    finally:
        node.close()


def test_guards_skip_and_count(tmp_path: Path) -> None:
    idle = DrillSchedule(cron="0 15 * * fri", drill="inject", gpu="idle", args="preset=xid79")
    node = start_drill_node(tmp_path, schedule=(idle, FRIDAY_15))
    try:
        service = drill_service(node)
        first, second = service.drills.entries
        assert service.drills.run(first) is None, "every sim GPU runs a process: none is idle"
        node.client.post("/v1/gpus/3/quarantine", json={"reason": "bad fan"}, headers=node.auth)
        assert service.drills.run(second) is None, "a quarter of the node is out: below require_healthy_share"
        with service.drills._running:
            assert service.drills.run(second) is None
        skipped = node.client.get("/v1/drills").json()["skipped"]
        assert skipped == [
            {"drill": "inject", "reason": "drill_running", "count": 1},
            {"drill": "inject", "reason": "no_idle_gpu", "count": 1},
            {"drill": "inject", "reason": "node_unhealthy", "count": 1},
        ]
        text = node.client.get("/metrics").text
        assert ({"drill": "inject", "reason": "no_idle_gpu"}, 1.0) in metric_samples(
            text, "gpuwatch_drill_skipped_total"
        )
        assert node.client.get("/v1/drills").json()["runs"] == [], "a skip is not a verdict"
        assert all(not g["findings"] for g in node.client.get("/v1/gpus").json()["gpus"])
    finally:
        node.close()


def test_pick_target() -> None:
    trainer = {"pid": 7, "rank": 0, "job_id": "j"}
    node = [
        Gpu.model_validate(g)
        for g in (
            fake_gpu(0, sample={"t": 0.0, "pids": [7]}, trainers=[trainer]),
            fake_gpu(1, sample={"t": 0.0, "pids": [99]}),
            fake_gpu(2),
            fake_gpu(3, state="degraded"),
        )
    ]
    share = DrillSchedule(cron="", drill="inject", require_healthy_share=0.75)
    assert pick_target(share, node) == 2, "idle: no process, no trainer"
    assert pick_target(DrillSchedule(cron="", drill="kill_rank", gpu="trainer", require_healthy_share=0.5), node) == 0
    with pytest.raises(DrillRefused, match="has trainers and skip_if_trainers is set"):
        pick_target(DrillSchedule(cron="", drill="inject", gpu="0", require_healthy_share=0.5), node)
    kill = DrillSchedule(cron="", drill="kill_rank", gpu="0", require_healthy_share=0.5)
    assert pick_target(kill, node) == 0, "kill_rank needs the trainer skip_if_trainers would avoid"
    with pytest.raises(DrillRefused, match="3 of 4 GPUs are healthy and in service") as refused:
        pick_target(DrillSchedule(cron="", drill="inject"), node)
    assert refused.value.reason == "node_unhealthy"
    with pytest.raises(DrillRefused) as missing:
        pick_target(DrillSchedule(cron="", drill="inject", gpu="8", require_healthy_share=0.0), node)
    assert missing.value.reason == "no_such_gpu"


def test_on_demand_runs_through_the_api(tmp_path: Path) -> None:
    node = start_drill_node(tmp_path)
    try:
        service = drill_service(node)
        headers = node.auth
        reset = {"drill": "reset_gpu", "gpu": "0"}
        assert node.client.post("/v1/drills/run", json=reset, headers=headers).status_code == 422
        bad = {"drill": "inject", "gpu": "1", "args": "preset=nope"}
        response = node.client.post("/v1/drills/run", json=bad, headers=headers)
        assert response.status_code == 422 and "preset=nope: unknown preset" in response.json()["detail"]
        good = {"drill": "inject", "gpu": "1", "args": "preset=xid79"}
        response = node.client.post("/v1/drills/run", json=good, headers=headers)
        assert response.status_code == 202, response.text
        (job,) = node.daemon.scheduler.get_jobs()  # pending: the sim node's scheduler is not started
        verdict = job.func(*job.args)
        assert verdict.result == "pass" and verdict.trigger == "api" and service.drills.busy is False
    finally:
        node.close()
