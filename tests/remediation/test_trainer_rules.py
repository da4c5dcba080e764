"""trainer_rules.py on synthetic reports: fragmentation, allocator retries, stragglers, grad-variance jumps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuwatch.config import TrainerConfig
from gpuwatch.health import trainer_rules
from gpuwatch.model import (
    REASON_HW_SLOWDOWN,
    REASON_SW_POWER_CAP,
    Finding,
    GpuSample,
    GpuStatic,
    GpuStatus,
    Health,
    Severity,
    TrainerInfo,
)

T0 = 1_800_000_000.0
CFG = TrainerConfig()
GIB = 2**30


def gpu(index: int, reasons: int = REASON_SW_POWER_CAP, state: Health = Health.HEALTHY, **extra: Any) -> GpuStatus:
    uuid = f"GPU-{index:08d}-0000-0000-0000-000000000000"
    sample = GpuSample(t=T0, index=index, uuid=uuid, clocks_event_reasons=reasons)
    return GpuStatus(static=GpuStatic(index=index, uuid=uuid), state=state, sample=sample, **extra)


GPUS = [gpu(i) for i in range(4)]


def report(pid: int, t: float, *, rank: int | None = None, job: str = "job-a", **fields: Any) -> TrainerInfo:
    index = rank if rank is not None else pid % 4
    return TrainerInfo(pid=pid, rank=index, job_id=job, gpu_uuid=GPUS[index].uuid, updated_t=T0 + t, **fields)


def timeline(pid: int, duration_s: float, every_s: float = 10.0, **fields: Any) -> list[TrainerInfo]:
    return [report(pid, i * every_s, **fields) for i in range(int(duration_s // every_s) + 1)]


def rules(findings: list[Finding] | tuple[Finding, ...]) -> set[str]:
    return {f.rule for f in findings}


# -- fragmentation ---------------------------------------------------------------------------------


def test_fragmentation_sustained_for_the_window_is_a_warning_on_that_gpu() -> None:
    reports = timeline(1, 300, reserved_bytes=10 * GIB, allocated_bytes=6 * GIB, inactive_split_bytes=3 * GIB)

    found = trainer_rules.fragmentation(reports, GPUS[1], CFG, now=T0 + 300)

    assert found is not None
    assert (found.rule, found.severity, found.index, found.uuid) == (
        "trainer_memory_fragmentation",
        Severity.WARNING,
        1,
        GPUS[1].uuid,
    )
    assert found.reason.startswith("rank 1 of job job-a: the caching allocator holds 40% of its 10.00 GiB reserved")
    assert "3.00 GiB in inactive split blocks" in found.reason


@pytest.mark.parametrize(
    ("allocated_gib", "duration_s", "fires"),
    [
        (6, 290, False),  # not yet the whole window
        (6, 300, True),
        (7.5, 600, False),  # 25%: under the 30% threshold
        (7, 600, False),  # exactly 30%: not above it
    ],
)
def test_fragmentation_threshold_and_window(allocated_gib: float, duration_s: float, fires: bool) -> None:
    reports = timeline(1, duration_s, reserved_bytes=10 * GIB, allocated_bytes=int(allocated_gib * GIB))

    assert (trainer_rules.fragmentation(reports, GPUS[1], CFG, now=T0 + duration_s) is not None) is fires


def test_one_good_report_restarts_the_fragmentation_window() -> None:
    bad = timeline(1, 600, reserved_bytes=10 * GIB, allocated_bytes=5 * GIB)
    bad[50] = replace(bad[50], allocated_bytes=9 * GIB)  # at t=500 s the allocator was tight again

    assert trainer_rules.fragmentation(bad, GPUS[1], CFG, now=T0 + 600) is None
    assert trainer_rules.fragmentation(bad, GPUS[1], CFG, now=T0 + 810) is None  # no new reports: not sustained yet
    assert trainer_rules.fragmentation_ratio(bad[-1]) == pytest.approx(0.5)


def test_no_allocator_stats_no_fragmentation() -> None:
    assert trainer_rules.fragmentation(timeline(1, 600), GPUS[1], CFG, now=T0 + 600) is None
    assert trainer_rules.fragmentation_ratio(report(1, 0, reserved_bytes=0, allocated_bytes=0)) is None


# -- allocator retries -----------------------------------------------------------------------------


def test_alloc_retry_rate_above_threshold_is_a_warning() -> None:
    reports = [report(2, t, num_alloc_retries=int(t / 60 * 15)) for t in range(0, 301, 30)]  # 15/min

    found = trainer_rules.alloc_retries(reports, GPUS[2], CFG, now=T0 + 300)

    assert found is not None
    assert (found.rule, found.severity, found.index) == ("trainer_alloc_retries", Severity.WARNING, 2)
    assert "75 allocator retries" in found.reason and "15.0/min" in found.reason


@pytest.mark.parametrize(
    ("points", "fires"),
    [
        ([(0, 100), (300, 130)], False),  # 6/min: the steady cost of a large job, under 10/min
        ([(0, 0), (10, 1)], False),  # one retry is no rate (counted over at least a minute)
        ([(0, 0), (10, 20)], True),  # a burst of 20 in 10 s: 20/min
        ([(0, 0)], False),
    ],
)
def test_alloc_retry_rate(points: list[tuple[float, int]], fires: bool) -> None:
    reports = [report(2, t, num_alloc_retries=n) for t, n in points]

    assert (trainer_rules.alloc_retries(reports, GPUS[2], CFG, now=T0 + points[-1][0]) is not None) is fires


# -- stragglers ------------------------------------------------------------------------------------


def _job(step_times: list[float], gpus: list[GpuStatus]) -> trainer_rules.Verdict:
    timelines = {100 + i: [report(100 + i, 0, rank=i, step_time_s=s)] for i, s in enumerate(step_times)}
    return trainer_rules.evaluate(timelines, gpus, CFG, now=T0)


def test_straggler_on_a_throttled_gpu_names_the_throttle() -> None:
    gpus = [*GPUS[:3], gpu(3, reasons=REASON_HW_SLOWDOWN | REASON_SW_POWER_CAP, state=Health.DEGRADED)]

    verdict = _job([0.50, 0.51, 0.49, 0.70], gpus)

    (found,) = [f for f in verdict.findings if f.rule == "trainer_straggler"]
    assert (found.severity, found.index, found.uuid) == (Severity.WARNING, 3, gpus[3].uuid)
    assert found.reason == "rank 3 of job job-a is 40% slower than its peers (0.7 s per step); GPU 3 is in HW slowdown"
    checks = {c.trainer.rank: c for c in verdict.stragglers}
    assert [checks[r].straggler for r in range(4)] == [False, False, False, True]
    assert checks[3].throttling and not checks[0].throttling


def test_straggler_on_a_healthy_gpu_says_so() -> None:
    verdict = _job([0.50, 0.51, 0.49, 0.70], GPUS)

    (found,) = verdict.findings
    assert found.reason.endswith("is 40% slower than its peers (0.7 s per step); its GPU looks healthy")
    assert not any(c.throttling for c in verdict.stragglers)


def test_straggler_on_a_degraded_gpu_without_throttle_names_the_state() -> None:
    bad = gpu(3, state=Health.DEGRADED)
    bad = replace(bad, findings=(Finding("thermal_margin_low", Severity.DEGRADED, "hot", index=3),))

    (found,) = _job([0.5, 0.5, 0.5, 0.8], [*GPUS[:3], bad]).findings

    assert found.reason.endswith("GPU 3 is degraded (thermal_margin_low)")


@pytest.mark.parametrize(
    "step_times",
    [
        [0.50, 0.55, 0.48, 0.60],  # 20% above the median of its peers: under 1.25
        [0.7],  # a rank alone has no peers
        [0.5, 0.0],  # no step time yet
    ],
)
def test_no_straggler(step_times: list[float]) -> None:
    assert "trainer_straggler" not in rules(_job(step_times, GPUS).findings)


def test_stragglers_are_judged_within_their_job() -> None:
    timelines = {
        1: [report(1, 0, rank=0, job="a", step_time_s=0.5)],
        2: [report(2, 0, rank=1, job="a", step_time_s=0.5)],
        3: [report(3, 0, rank=2, job="b", step_time_s=2.0)],  # another job, slower by design
        4: [report(4, 0, rank=3, job="b", step_time_s=2.0)],
    }

    verdict = trainer_rules.evaluate(timelines, GPUS, CFG, now=T0)

    assert verdict.findings == ()
    assert len(verdict.stragglers) == 4


# -- gradient-norm variance ------------------------------------------------------------------------


def test_grad_variance_jump_is_an_info_finding_on_the_job() -> None:
    reports = [report(1, t, grad_norm_var=0.01 + 0.001 * (t % 3)) for t in range(0, 600, 10)]
    reports.append(report(1, 600, grad_norm_var=0.5))

    verdict = trainer_rules.evaluate({1: reports}, GPUS, CFG, now=T0 + 600)

    (found,) = verdict.findings
    assert (found.rule, found.severity, found.index) == ("trainer_grad_variance_jump", Severity.INFO, -1)
    assert found.reason.startswith("job job-a: gradient-norm variance over the last 100 steps is 0.5, 45×")


@pytest.mark.parametrize(
    ("values", "fires"),
    [
        ([0.01] * 30 + [0.05], False),  # 5×: under 10×
        ([0.01] * 5 + [0.5], False),  # too little history for a running level
        ([0.0] * 30 + [0.5], False),  # no level to compare to
        ([0.01] * 30 + [0.2], True),
    ],
)
def test_grad_variance_jump(values: list[float], fires: bool) -> None:
    series = [(T0 + 10 * i, v) for i, v in enumerate(values)]

    found = trainer_rules.grad_variance_jump("job-a", series, CFG, now=series[-1][0])

    assert (found is not None) is fires


def test_grad_variance_history_older_than_its_window_is_no_level() -> None:
    series = [(T0 + 10 * i, 0.01) for i in range(30)] + [(T0 + 3600, 0.5)]

    assert trainer_rules.grad_variance_jump("job-a", series, CFG, now=T0 + 3600) is None


def progress(
    *ranks: TrainerInfo, advanced: float = 0.0, states: tuple[trainer_rules.RankState, ...] = ()
) -> trainer_rules.JobProgress:
    states = states or tuple(trainer_rules.RankState() for _ in ranks)
    return trainer_rules.JobProgress("job-a", ranks, tuple(T0 + advanced for _ in ranks), states)


def busy(util: int) -> dict[str, GpuStatus]:
    return {g.uuid: replace(g, sample=replace(g.sample, util_gpu_pct=util)) for g in GPUS if g.sample is not None}


State = trainer_rules.RankState
NOTHING = State()


@pytest.mark.parametrize(
    ("now_s", "stuck", "util", "gpus_seen", "p99", "other", "hung"),
    [
        (61, NOTHING, 0, True, None, NOTHING, "its GPUs sit idle"),  # idle GPUs past the 60 s floor
        (59, NOTHING, 0, True, None, NOTHING, ""),  # not long enough
        (61, NOTHING, 100, True, None, NOTHING, ""),  # busy GPUs, every rank reporting: a long step
        (61, NOTHING, 0, False, None, NOTHING, ""),  # the backend does not see the job's GPUs (sim)
        (3, State(stopped_s=1.0), 100, True, None, NOTHING, "is stopped (SIGSTOP) for 1 s"),  # stopped: 1 s
        (3, State(stopped_s=0.9), 100, True, None, NOTHING, ""),
        (3, State(stopped_s=1.0), 100, True, None, State(paused="eval"), "is stopped"),  # no pause explains T
        (11, State(quiet_s=10.0), 0, True, None, NOTHING, "used no CPU time on its main thread"),  # frozen: 10 s
        (11, State(quiet_s=10.0), 0, False, None, NOTHING, "used no CPU time"),  # unseen GPU: CPU and step suffice
        (11, State(quiet_s=9.0), 0, True, None, NOTHING, ""),
        (11, State(quiet_s=10.0), 100, True, None, NOTHING, ""),  # its GPU works: a long kernel, not frozen
        (31, State(quiet_s=30.0), 0, False, 2.0, NOTHING, ""),  # 20 × its 2 s p99 step is the limit: 40 s
        (41, State(quiet_s=40.0), 0, False, 2.0, NOTHING, "(limit 40 s)"),
        (31, State(quiet_s=30.0), 0, False, None, State(paused="checkpoint"), ""),  # a peer saves: the job waits
        (70, NOTHING, 100, False, None, NOTHING, ""),  # reports stopped arriving and nothing else: no hang
    ],
)
def test_trainer_hang(
    now_s: float,
    stuck: trainer_rules.RankState,
    util: int,
    gpus_seen: bool,
    p99: float | None,
    other: trainer_rules.RankState,
    hung: str,
) -> None:
    frozen = report(1, 0, rank=0, step=40, step_time_p99_s=p99)
    waiting = report(2, now_s, rank=1, step=40, step_time_p99_s=p99)

    job = progress(frozen, waiting, states=(stuck, other))
    found = trainer_rules.hang(job, busy(util), CFG, T0 + now_s, gpus_seen=gpus_seen)

    assert (found is not None) == bool(hung)
    if found is not None:
        assert (found.rule, found.severity, found.action.value, found.index) == (
            "trainer_hang",
            Severity.WARNING,
            "restart_app",
            0,
        )
        assert found.reason.startswith("job job-a: no rank got past step 40; ")
        assert hung in found.reason


def test_a_job_without_steps_never_hangs() -> None:
    quiet = report(1, 0, rank=0)
    assert trainer_rules.hang(progress(quiet), busy(0), CFG, T0 + 3600, gpus_seen=True) is None
