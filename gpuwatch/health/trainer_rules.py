"""Pure rules on the trainers' own reports, judged beside their GPUs' hardware state.

Each rank's reports come as a timeline (oldest first, `updated_t` set, `gpu_uuid` resolved).
Like the GPU rules, windows are seconds, never report counts, and nothing here reads a file or
the clock. None of these findings quarantines anything: a fragmented allocator or a slow rank is
the job's problem to fix, and the operator needs to know whether the hardware is to blame.

* `trainer_memory_fragmentation`: (reserved − allocated) / reserved above `fragmentation_ratio` in
  every report of the last `fragmentation_window_s` (warning on the rank's GPU).
* `trainer_alloc_retries`: cudaMalloc retries (each a cache flush and a stall) above
  `alloc_retries_per_min` over `alloc_retries_window_s` (warning on the rank's GPU).
* `trainer_straggler`: a rank whose step time is `straggler_ratio` above the median of its peers in the
  same job on this node, reported with its GPU's throttle reasons and state (warning on that GPU).
* `trainer_grad_variance_jump`: the job's grad-norm variance (over the last 100 steps) above
  `grad_var_jump` × its median over `grad_var_history_s` (info on the job: a data-distribution shift).
* `trainer_hang` (warning on the job; remediation may restart it), on positive evidence only, the
  surest first: a rank stopped (state T) with its step still for `hang_stopped_after_s`; a rank
  whose main thread's CPU time and step stood still for `hang_frozen_after_s` or
  `hang_frozen_step_times` × its p99 step time (whichever is longer), its GPU not busy where the
  backend sees it; or no rank of the job advanced its step for `hang_after_s` (or `hang_step_times`
  × its recent step time, if longer) with a rank quiet for `stale_after_s` or, where the backend
  sees them, all its GPUs idle. A pause a rank declared (TrainerLink.pause) is progress while it
  lasts, and while any rank of the job is in one no rank of it is taken for frozen: only a stopped
  process is no pause. A report that stopped arriving is no evidence by itself: its rank may
  simply be unable to send it.

A job is its user and its id: ranks of two users with the same job id are two jobs (peers,
stragglers and variance are judged within one job only).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuwatch.config import TrainerConfig
from gpuwatch.health.rules.clocks import THROTTLE_RULES
from gpuwatch.model import Action, Finding, GpuStatus, Health, Severity, TrainerInfo

FRAGMENTATION = "trainer_memory_fragmentation"
ALLOC_RETRIES = "trainer_alloc_retries"
STRAGGLER = "trainer_straggler"
GRAD_VARIANCE = "trainer_grad_variance_jump"
HANG = "trainer_hang"
RULE_IDS: tuple[str, ...] = (FRAGMENTATION, ALLOC_RETRIES, STRAGGLER, GRAD_VARIANCE, HANG)

MIN_RETRY_SPAN_S = 60.0  # a rate is per minute: a burst within seconds counts as one minute's worth
MIN_BASELINE_POINTS = 10  # fewer earlier variances are no running level


@dataclass(frozen=True)
class StragglerCheck:
    """One rank's step time against its peers' median; `throttling` when its GPU has a fault reason bit set."""

    trainer: TrainerInfo
    ratio: float
    straggler: bool
    throttling: bool
    hardware: str


@dataclass(frozen=True)
class RankState:
    """What the judge saw of one rank's process since its last progress (a step, or the end of a declared pause)."""

    stopped_s: float = 0.0  # seen stopped (state T) this long with its step still; 0: not stopped
    quiet_s: float = 0.0  # its main thread's CPU time and its step stood still this long (0 in a declared pause)
    paused: str = ""  # the pause it declared and is in, "" when none


@dataclass(frozen=True)
class JobProgress:
    """One job's ranks on this node: each one's latest report, its last progress and what its process does.

    `advanced_t[i]` is when rank i last made progress: its last step, or a declared pause (in force:
    now; over: when it ended). `states[i]` is the judge's evidence about rank i's process.
    """

    job: str
    latest: tuple[TrainerInfo, ...]
    advanced_t: tuple[float, ...]
    states: tuple[RankState, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """Every trainer finding of one round, and the straggler check of each rank that has peers."""

    findings: tuple[Finding, ...]
    stragglers: tuple[StragglerCheck, ...]


def evaluate(
    timelines: Mapping[int, Sequence[TrainerInfo]], gpus: Sequence[GpuStatus], cfg: TrainerConfig, now: float
) -> Verdict:
    """Judge every rank (pid → its reports, oldest first) and every job once."""
    by_uuid = {g.uuid: g for g in gpus}
    findings: list[Finding] = []
    for timeline in timelines.values():
        if not timeline:
            continue
        gpu = by_uuid.get(timeline[-1].gpu_uuid or "")
        for rule in (fragmentation(timeline, gpu, cfg, now), alloc_retries(timeline, gpu, cfg, now)):
            if rule is not None:
                findings.append(rule)
    latest = [t[-1] for t in timelines.values() if t]
    checks = straggler_checks(latest, by_uuid, cfg)
    findings += [_straggler_finding(c, by_uuid, now) for c in checks if c.straggler]
    for (_, job), series in _variance_series(timelines).items():
        jump = grad_variance_jump(job, series, cfg, now)
        if jump is not None:
            findings.append(jump)
    return Verdict(tuple(findings), tuple(checks))


def fragmentation_ratio(report: TrainerInfo) -> float | None:
    """(reserved − allocated) / reserved: memory the allocator holds but no tensor uses; None when unknown."""
    if not report.reserved_bytes or report.allocated_bytes is None:
        return None
    return max(0.0, (report.reserved_bytes - report.allocated_bytes) / report.reserved_bytes)


def fragmentation(
    timeline: Sequence[TrainerInfo], gpu: GpuStatus | None, cfg: TrainerConfig, now: float
) -> Finding | None:
    """Above the ratio in every report over at least `fragmentation_window_s` up to the latest: not one bad moment."""
    last = timeline[-1]
    since = None
    for report in reversed(timeline):
        ratio = fragmentation_ratio(report)
        if ratio is None or ratio <= cfg.fragmentation_ratio:
            break
        since = report.updated_t
    if since is None or last.updated_t is None or last.updated_t - since < cfg.fragmentation_window_s:
        return None
    ratio = fragmentation_ratio(last) or 0.0
    split = f", {_gib(last.inactive_split_bytes)} in inactive split blocks" if last.inactive_split_bytes else ""
    reason = (
        f"{_who(last)}: the caching allocator holds {ratio:.0%} of its {_gib(last.reserved_bytes)} reserved memory "
        f"unused{split} for over {cfg.fragmentation_window_s:g} s; "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually helps"
    )
    return _finding(FRAGMENTATION, Severity.WARNING, reason, gpu, now)


def alloc_retries(
    timeline: Sequence[TrainerInfo], gpu: GpuStatus | None, cfg: TrainerConfig, now: float
) -> Finding | None:
    """cudaMalloc retries per minute over the window (at least a minute), from the rank's own counter."""
    window = [r for r in timeline if r.updated_t is not None and r.updated_t >= now - cfg.alloc_retries_window_s]
    counted = [r for r in window if r.num_alloc_retries is not None]
    if len(counted) < 2:
        return None
    first, last = counted[0], counted[-1]
    grown = (last.num_alloc_retries or 0) - (first.num_alloc_retries or 0)
    span = (last.updated_t or 0.0) - (first.updated_t or 0.0)
    per_min = grown / max(span, MIN_RETRY_SPAN_S) * 60.0
    if per_min <= cfg.alloc_retries_per_min:
        return None
    reason = (
        f"{_who(last)}: {grown} allocator retries (cache flush + cudaMalloc retry, each a stall) in {span:.0f} s, "
        f"{per_min:.1f}/min; memory pressure or fragmentation is costing steps"
    )
    return _finding(ALLOC_RETRIES, Severity.WARNING, reason, gpu, now)


def straggler_checks(
    latest: Sequence[TrainerInfo], gpus: Mapping[str, GpuStatus], cfg: TrainerConfig
) -> list[StragglerCheck]:
    """Each rank's step time against the median of its peers (same job, this node); needs two ranks."""
    jobs: dict[tuple[int | None, str], list[TrainerInfo]] = {}
    for report in latest:
        if report.step_time_s and report.step_time_s > 0:
            jobs.setdefault((report.uid, report.job_id or ""), []).append(report)
    checks = []
    for ranks in jobs.values():
        if len(ranks) < 2:
            continue
        for report in ranks:
            peers = statistics.median(r.step_time_s or 0.0 for r in ranks if r is not report)
            ratio = (report.step_time_s or 0.0) / peers if peers > 0 else 1.0
            gpu = gpus.get(report.gpu_uuid or "")
            throttling, hardware = hardware_state(gpu)
            checks.append(StragglerCheck(report, ratio, ratio >= cfg.straggler_ratio, throttling, hardware))
    return checks


def hardware_state(gpu: GpuStatus | None) -> tuple[bool, str]:
    """Whether the GPU is throttled by a fault reason bit, and a phrase saying what its hardware is doing."""
    if gpu is None:
        return False, "its GPU is not one gpuwatch watches"
    reasons = gpu.sample.clocks_event_reasons if gpu.sample is not None else None
    active = [label for bit, label in THROTTLE_RULES.values() if reasons is not None and reasons & bit]
    if active:
        return True, f"GPU {gpu.index} is in {' and '.join(active)}"
    if gpu.state in {Health.DEGRADED, Health.UNHEALTHY}:
        rules = ", ".join(f.rule for f in gpu.findings if f.severity.health is gpu.state)
        return False, f"GPU {gpu.index} is {gpu.state.value}" + (f" ({rules})" if rules else "")
    return False, "its GPU looks healthy"


def grad_variance_jump(
    job: str, series: Sequence[tuple[float, float]], cfg: TrainerConfig, now: float
) -> Finding | None:
    """The latest variance (series oldest first, (t, variance)) far above the median of the earlier ones."""
    if not series:
        return None
    latest_t, latest = series[-1]
    earlier = [v for t, v in series[:-1] if now - t <= cfg.grad_var_history_s]
    if len(earlier) < MIN_BASELINE_POINTS:
        return None
    level = statistics.median(earlier)
    if level <= 0 or latest <= cfg.grad_var_jump * level:
        return None
    reason = (
        f"job {job or '(unnamed)'}: gradient-norm variance over the last 100 steps is {latest:.3g}, "
        f"{latest / level:.0f}× its running level {level:.3g}; the data distribution may have shifted"
    )
    return Finding(GRAD_VARIANCE, Severity.INFO, reason, Action.NONE, t=now)


def hang(
    progress: JobProgress, gpus: Mapping[str, GpuStatus], cfg: TrainerConfig, now: float, *, gpus_seen: bool
) -> Finding | None:
    """The job is hung: a rank stopped, a rank frozen, or its steps stopped past the long limit with evidence."""
    latest = progress.latest
    if not latest or not progress.advanced_t:
        return None
    states = progress.states or tuple(RankState() for _ in latest)
    ranks = list(zip(latest, states, strict=False))
    stopped = [(r, s) for r, s in ranks if s.stopped_s >= cfg.hang_stopped_after_s]
    if stopped:
        why = ", ".join(f"{_who(r)} is stopped (SIGSTOP) for {s.stopped_s:.0f} s" for r, s in stopped)
        return _hang_finding(progress, gpus, now, f"{why} (limit {cfg.hang_stopped_after_s:g} s)")
    if any(r.step is None for r in latest):
        return None
    if not any(s.paused for s in states):
        frozen = [
            (r, s, limit)
            for r, s in ranks
            if s.quiet_s >= (limit := frozen_limit(r, cfg)) and not _gpu_busy(r, gpus, cfg, gpus_seen)
        ]
        if frozen:
            why = ", ".join(
                f"{_who(r)} used no CPU time on its main thread and finished no step for {s.quiet_s:.0f} s "
                f"(limit {limit:.0f} s)"
                for r, s, limit in frozen
            )
            return _hang_finding(progress, gpus, now, why)
    stalled_s = now - max(progress.advanced_t)
    times = [r.step_time_s for r in latest if r.step_time_s]
    limit = max(cfg.hang_after_s, cfg.hang_step_times * statistics.median(times)) if times else cfg.hang_after_s
    if stalled_s < limit:
        return None
    quiet = [(r, s) for r, s in ranks if s.quiet_s >= cfg.stale_after_s]
    samples = [gpus[r.gpu_uuid].sample if r.gpu_uuid is not None and r.gpu_uuid in gpus else None for r in latest]
    idle = gpus_seen and all(s is not None and (s.util_gpu_pct or 0) <= cfg.hang_idle_util_pct for s in samples)
    if not quiet and not idle:
        return None
    why = ", ".join(f"{_who(r)} made no progress for {s.quiet_s:.0f} s" for r, s in quiet) or "its GPUs sit idle"
    return _hang_finding(progress, gpus, now, f"{why}; no step for {stalled_s:.0f} s (limit {limit:.0f} s)")


def frozen_limit(report: TrainerInfo, cfg: TrainerConfig) -> float:
    """How long a rank's main thread and step may stand still before it is frozen: its p99 step time counts."""
    p99 = report.step_time_p99_s or report.step_time_s or 0.0
    return max(cfg.hang_frozen_after_s, cfg.hang_frozen_step_times * p99)


def _gpu_busy(report: TrainerInfo, gpus: Mapping[str, GpuStatus], cfg: TrainerConfig, gpus_seen: bool) -> bool:
    """Where the backend sees the rank's GPU, whether it works: a long kernel, not a frozen rank."""
    gpu = gpus.get(report.gpu_uuid or "") if gpus_seen else None
    sample = gpu.sample if gpu is not None else None
    return sample is not None and (sample.util_gpu_pct or 0) > cfg.hang_idle_util_pct


def _hang_finding(progress: JobProgress, gpus: Mapping[str, GpuStatus], now: float, why: str) -> Finding:
    steps = [r.step for r in progress.latest if r.step is not None]
    at = f"no rank got past step {min(steps)}" if steps else "no rank finished a step"
    reason = f"job {progress.job}: {at}; {why}"
    first = min(progress.latest, key=lambda r: (r.rank is None, r.rank or 0))
    return _finding(HANG, Severity.WARNING, reason, gpus.get(first.gpu_uuid or ""), now, Action.RESTART_APP)


def _variance_series(
    timelines: Mapping[int, Sequence[TrainerInfo]],
) -> dict[tuple[int | None, str], list[tuple[float, float]]]:
    """Per job (uid, id), every rank's (t, grad-norm variance) by time: DDP ranks share the all-reduced gradients."""
    series: dict[tuple[int | None, str], list[tuple[float, float]]] = {}
    for timeline in timelines.values():
        for report in timeline:
            if report.grad_norm_var is not None and report.updated_t is not None:
                key = (report.uid, report.job_id or "")
                series.setdefault(key, []).append((report.updated_t, report.grad_norm_var))
    return {job: sorted(points) for job, points in series.items()}


def _straggler_finding(check: StragglerCheck, gpus: Mapping[str, GpuStatus], now: float) -> Finding:
    report = check.trainer
    reason = (
        f"{_who(report)} is {check.ratio - 1:.0%} slower than its peers "
        f"({report.step_time_s:.3g} s per step); {check.hardware}"
    )
    return _finding(STRAGGLER, Severity.WARNING, reason, gpus.get(report.gpu_uuid or ""), now)


def _finding(
    rule: str, severity: Severity, reason: str, gpu: GpuStatus | None, now: float, action: Action = Action.NONE
) -> Finding:
    index, uuid = (gpu.index, gpu.uuid) if gpu is not None else (-1, "")
    return Finding(rule, severity, reason, action, t=now, index=index, uuid=uuid)


def _who(report: TrainerInfo) -> str:
    rank = f"rank {report.rank}" if report.rank is not None else f"pid {report.pid}"
    return rank + (f" of job {report.job_id}" if report.job_id else "")


def _gib(value: int | None) -> str:
    return f"{(value or 0) / 2**30:.2f} GiB"
