"""Quarantine → stop the job's ranks on this node, and keep each quarantine as an incident.

A monitor listener. After every publish it maps ranks to GPUs (gpuwatch.ranks), judges the
trainers' reports (gpuwatch.health.trainer_rules) and keeps both for /v1/trainers and the
trainer metrics. On a quarantine decision (status.json already says so) a background thread,
never the sampling thread:

1. sends `trainer.stop_signal` to the ranks on that GPU and to every rank of the same job on this
   node (one lost rank stalls a data-parallel job), each recognised by PID and start time;
2. waits `trainer.grace_period_s` for them to checkpoint and exit 75, then sends SIGTERM, then
   after `trainer.kill_after_s` SIGKILL, noting how each rank ended;
3. watches the trainers' reports for new PIDs of the same job reporting a step: the resume.

The incident (SQLite, GET /v1/incidents, gpuwatch_incident_* gauges of the latest) records the GPU,
cause, job, ranks, time to stop (decision → last rank gone), time to resume (decision → the first
report of the new launch that carries a step; reports come every few seconds, so it errs late by up
to one report interval) and steps lost (the last step seen before the stop minus the first step
reported after the resume, at least 0: a lower bound, since the first report may come a few steps in).

`install(daemon)` wires it into a Daemon (listener, routes, metric families, render-cache key).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatch.config import Config
from gpuwatch.errors import ConfigError, GpuwatchError
from gpuwatch.health import trainer_rules
from gpuwatch.health.state import Decision
from gpuwatch.model import Snapshot, TrainerInfo
from gpuwatch.monitor import Monitor
from gpuwatch.ranks import PID_BACKENDS, ProcFs, Rank, map_ranks
from gpuwatch.runtime import RuntimeDir
from gpuwatch.store import Store

log = logging.getLogger("gpuwatch.remediation")

POLL_S = 0.02  # how often a stop checks whether the ranks are gone
REPORT_POLL_S = 0.1  # how often a stop or a resume watch re-reads the trainers' reports
FAST_WATCH_S = 600.0  # a resume within this is timed to REPORT_POLL_S; later ones to SLOW_POLL_S
SLOW_POLL_S = 5.0
RESUME_WATCH_S = 6 * 3600.0  # a job not back by then is not coming back through this node
LABELS = ["gpu", "uuid", "rank", "job_id"]


class _Collector(Protocol):
    @property
    def extras(self) -> list[Callable[[], Iterable[Metric]]]: ...


class DaemonParts(Protocol):
    """What `install` needs of gpuwatch.daemon.Daemon."""

    @property
    def config(self) -> Config: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def store(self) -> Store: ...
    @property
    def runtime(self) -> RuntimeDir: ...
    @property
    def monitor(self) -> Monitor: ...
    @property
    def collector(self) -> _Collector: ...
    @property
    def route_hooks(self) -> list[Callable[[FastAPI, Callable[..., None]], None]]: ...
    @property
    def key_parts(self) -> list[Callable[[], object]]: ...
    @property
    def gpu_views(self) -> list[Callable[[int], dict[str, Any]]]: ...


def install(daemon: DaemonParts) -> Remediation:
    """Hook remediation into a Daemon: monitor listener, /v1/incidents and /v1/trainers, metrics, render key."""
    remediation = Remediation(daemon.config, daemon.store, daemon.runtime, clock=daemon.clock)
    daemon.monitor.listeners.append(remediation.on_publish)
    daemon.route_hooks.append(remediation.add_routes)
    daemon.collector.extras.append(remediation.collect)
    daemon.key_parts.append(remediation.version)
    daemon.gpu_views.append(remediation.gpu_view)
    return remediation


def parse_signal(name: str) -> signal.Signals:
    """`SIGUSR1` (or `USR1`, or a number) as a signal.

    Raises:
        ConfigError: naming trainer.stop_signal.
    """
    text = name.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(f"trainer.stop_signal: {name!r} is not a signal") from None


@dataclass
class _Target:
    """A rank being stopped, and how it ended: exited, SIGTERM, SIGKILL, or running (could not be stopped)."""

    rank: Rank
    on_gpu: bool
    ended: str | None = None

    def as_dict(self) -> dict[str, Any]:
        info = self.rank.info
        return {
            "pid": info.pid,
            "rank": info.rank,
            "local_rank": info.local_rank,
            "gpu": self.rank.gpu,
            "job": info.job_id,
            "on_quarantined_gpu": self.on_gpu,
            "ended": self.ended,
        }


@dataclass
class _Incident:
    """One quarantine being handled: the decision's time, the ranks, and the body stored in SQLite."""

    decision: Decision
    seen_mono: float  # time.monotonic() when the listener saw the decision
    seen_lag_s: float  # clock() − decision.t at that moment
    targets: list[_Target]
    body: dict[str, Any]
    id: int = 0
    last_step: int | None = None
    jobs: frozenset[str] = field(default_factory=frozenset)

    def since_decision(self) -> float:
        return round(self.seen_lag_s + time.monotonic() - self.seen_mono, 3)


class Remediation:
    """Stops trainers on quarantined GPUs, records incidents, and judges and exports the trainers' reports."""

    def __init__(
        self,
        config: Config,
        store: Store,
        runtime: RuntimeDir,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = config.trainer
        self.store = store
        self.runtime = runtime
        self.clock = clock
        self.proc = ProcFs()
        self.stop_signal = parse_signal(self.cfg.stop_signal)
        self._keep_s = max(
            self.cfg.fragmentation_window_s, self.cfg.alloc_retries_window_s, self.cfg.grad_var_history_s
        )
        self._lock = threading.Lock()
        self._version = 0
        self._ranks: list[Rank] = []
        self._verdict = trainer_rules.Verdict((), ())
        self._timelines: dict[int, deque[TrainerInfo]] = {}
        self._active: set[tuple[str, int]] = set()
        self._stopping: set[int] = set()
        latest = store.incidents(limit=100)
        self._incidents_total = int(latest[0]["id"]) if latest else 0
        self._last_incident: dict[str, Any] | None = next((i for i in latest if i.get("ranks")), None)

    # -- the listener ---------------------------------------------------------------------------

    def on_publish(self, snapshot: Snapshot, decisions: list[Decision]) -> None:
        """After each publish: map and judge the ranks; start a stop for each quarantine. Never waits.

        The monitor calls its listeners under its lock, so two calls never overlap.
        """
        ranks = self._map(snapshot, list(snapshot.trainers))  # the monitor read the reports for this Snapshot
        verdict = self._judge(snapshot, ranks)
        with self._lock:
            self._ranks, self._verdict = ranks, verdict
            self._version += 1
        for decision in decisions:
            if decision.kind == "quarantine":
                self._start_stop(decision, snapshot, ranks)

    def _read_reports(self, now: float) -> list[TrainerInfo]:
        try:
            return self.runtime.read_trainers(now, self.cfg.stale_after_s)
        except OSError as exc:
            log.warning("cannot read trainer reports in %s: %s", self.runtime.trainers, exc)
            return []

    def _map(self, snapshot: Snapshot, reports: list[TrainerInfo]) -> list[Rank]:
        owners: dict[int, int | None] = {}
        for report in reports:
            try:
                owners[report.pid] = (self.runtime.trainers / f"{report.pid}.json").stat().st_uid
            except OSError:
                owners[report.pid] = None
        return map_ranks(
            snapshot.gpus, reports, self.proc, use_pids=snapshot.backend in PID_BACKENDS, report_owner=owners
        )

    def _judge(self, snapshot: Snapshot, ranks: list[Rank]) -> trainer_rules.Verdict:
        """Extend each rank's timeline with its new report, judge them all, log findings as they appear."""
        live = {r.pid for r in ranks}
        for pid in [pid for pid in self._timelines if pid not in live]:
            del self._timelines[pid]
        for rank in ranks:
            if rank.info.updated_t is None:
                continue
            timeline = self._timelines.setdefault(rank.pid, deque())
            if not timeline or timeline[-1].updated_t != rank.info.updated_t:
                timeline.append(rank.info)
            while timeline and (timeline[0].updated_t or 0.0) < snapshot.t - self._keep_s:
                timeline.popleft()
        verdict = trainer_rules.evaluate(self._timelines, snapshot.gpus, self.cfg, snapshot.t)
        active = {(f.rule, f.index) for f in verdict.findings}
        for f in verdict.findings:
            if (f.rule, f.index) not in self._active:
                log.warning("trainer finding %s on GPU %d: %s", f.rule, f.index, f.reason)
        self._active = active
        return verdict

    # -- stopping -------------------------------------------------------------------------------

    def _start_stop(self, decision: Decision, snapshot: Snapshot, ranks: list[Rank]) -> None:
        gpu = snapshot.gpu(decision.index)
        on_gpu = [r for r in ranks if r.gpu == decision.index]
        jobs = frozenset(r.job for r in on_gpu if r.job)
        users = {r.uid for r in on_gpu}
        peers = [r for r in ranks if r.gpu != decision.index and r.job in jobs and r.uid in users]
        with self._lock:
            targets = [_Target(r, r.gpu == decision.index) for r in on_gpu + peers if r.pid not in self._stopping]
            self._stopping.update(t.rank.pid for t in targets)
        steps = [r.info.step for r in on_gpu + peers if r.info.step is not None]
        incident = _Incident(
            decision=decision,
            seen_mono=time.monotonic(),
            seen_lag_s=max(0.0, self.clock() - decision.t),
            targets=targets,
            body={
                "gpu": decision.index,
                "uuid": gpu.uuid if gpu else "",
                "cause": decision.reason,
                "auto": decision.auto,
                "drill": decision.drill,
                "job": ",".join(sorted(jobs)) or None,
                "stop_signal": self.stop_signal.name,
                "status": "stopping" if targets else "no_trainers",
                "ranks": [],
                "time_to_stop_s": None if targets else 0.0,
                "time_to_resume_s": None,
                "steps_lost": None,
                "last_step": max(steps, default=None),
                "resumed_step": None,
            },
            last_step=max(steps, default=None),
            jobs=jobs,
        )
        threading.Thread(
            target=self._handle, args=(incident,), name=f"gpuwatch-stop-gpu{decision.index}", daemon=True
        ).start()

    def _handle(self, incident: _Incident) -> None:
        """The incident's thread: signal, record, escalate, then watch for the resume."""
        try:
            for target in incident.targets:
                self._signal(target, self.stop_signal)
            self._save(incident, new=True)
            if incident.targets:
                self._stop(incident)
        finally:
            with self._lock:
                self._stopping.difference_update(t.rank.pid for t in incident.targets)
        if incident.jobs:
            self._watch_resume(incident)

    def _stop(self, incident: _Incident) -> None:
        index = incident.decision.index
        log.warning("GPU %d quarantined: sent %s to %s", index, self.stop_signal.name, _pids(incident.targets))
        phases = [
            (self.cfg.grace_period_s, signal.SIGTERM),
            (self.cfg.kill_after_s, signal.SIGKILL),
            (self.cfg.kill_after_s, None),
        ]
        how = "exited"
        for wait_s, escalate in phases:
            alive = self._wait(incident, wait_s, how)
            if not alive:
                break
            if escalate is None:
                for target in alive:
                    target.ended = "running"
                log.error("GPU %d: %s survived SIGKILL", index, _pids(alive))
                break
            log.warning("GPU %d: %s still running after %g s: sending %s", index, _pids(alive), wait_s, escalate.name)
            for target in alive:
                self._signal(target, escalate)
            how = escalate.name
        stopped = all(t.ended != "running" for t in incident.targets)
        incident.body.update(status="stopped", time_to_stop_s=incident.since_decision() if stopped else None)
        self._save(incident)
        log.warning("GPU %d: job stopped in %s s: %s", index, incident.body["time_to_stop_s"], incident.body["ranks"])

    def _wait(self, incident: _Incident, wait_s: float, how: str) -> list[_Target]:
        """Poll until every target is gone or `wait_s` passed; mark the gone ones `how`; the ones left."""
        deadline = time.monotonic() + wait_s
        next_report = 0.0
        while True:
            alive = []
            for target in incident.targets:
                if target.ended is None and self.proc.alive(target.rank.pid, target.rank.start_time):
                    alive.append(target)
                elif target.ended is None:
                    target.ended = how
            now = time.monotonic()
            if not alive or now >= deadline:
                return alive
            if now >= next_report:  # the ranks' last reports before they go: the step they stopped at
                next_report = now + REPORT_POLL_S
                pids = {t.rank.pid for t in alive}
                steps = [r.step for r in self._read_reports(self.clock()) if r.pid in pids and r.step is not None]
                if incident.last_step is not None:
                    steps.append(incident.last_step)
                incident.last_step = max(steps, default=None)
            time.sleep(POLL_S)

    def _signal(self, target: _Target, sig: signal.Signals) -> None:
        pid = target.rank.pid
        if not self.proc.alive(pid, target.rank.start_time):
            return  # gone, or the PID now belongs to another process: never signal that one
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.error("not allowed to send %s to pid %d (rank %s)", sig.name, pid, target.rank.info.rank)

    # -- resuming -------------------------------------------------------------------------------

    def _watch_resume(self, incident: _Incident) -> None:
        """Wait for a new process of the same job to report a step: that launch resumed the job."""
        gone = {t.rank.pid for t in incident.targets}
        started = time.monotonic()
        while time.monotonic() - started < RESUME_WATCH_S:
            resumed = [
                r
                for r in self._read_reports(self.clock())
                if r.job_id in incident.jobs
                and r.pid not in gone
                and r.step is not None
                and (r.updated_t or 0.0) > incident.decision.t
            ]
            if resumed:
                first = min(resumed, key=lambda r: (r.updated_t or 0.0, r.step or 0))
                step = min(r.step or 0 for r in resumed)
                incident.body.update(
                    status="resumed",
                    time_to_resume_s=round((first.updated_t or 0.0) - incident.decision.t, 3),
                    resumed_step=step,
                    steps_lost=max(0, incident.last_step - step) if incident.last_step is not None else None,
                )
                self._save(incident)
                log.warning(
                    "job %s resumed at step %d, %.1f s after GPU %d was quarantined",
                    incident.body["job"],
                    step,
                    incident.body["time_to_resume_s"],
                    incident.decision.index,
                )
                return
            time.sleep(REPORT_POLL_S if time.monotonic() - started < FAST_WATCH_S else SLOW_POLL_S)
        incident.body.update(status="not_resumed")
        self._save(incident)

    def _save(self, incident: _Incident, new: bool = False) -> None:
        """Store the incident's body; a failing store (closed at shutdown) must not stop the escalation."""
        incident.body.update(ranks=[t.as_dict() for t in incident.targets], last_step=incident.last_step)
        try:
            if new:
                incident.id = self.store.add_incident(incident.decision.t, incident.body)
            elif incident.id:
                self.store.update_incident(incident.id, incident.body)
        except GpuwatchError as exc:
            log.error("cannot store the incident on GPU %d: %s", incident.decision.index, exc)
        with self._lock:
            if new:
                self._incidents_total += 1
            if incident.targets:  # an idle GPU's quarantine has no stop or resume to report
                self._last_incident = {"id": incident.id, "t": incident.decision.t, **incident.body}
            self._version += 1

    # -- serving --------------------------------------------------------------------------------

    def version(self) -> object:
        """Changes whenever what `collect` yields may have changed (the metrics render cache key)."""
        return self._version

    def trainers(self) -> dict[str, Any]:
        """GET /v1/trainers: every rank with its GPU and sources, and the trainer findings."""
        with self._lock:
            ranks, verdict = list(self._ranks), self._verdict
        return {
            "ranks": [_rank_json(r) for r in ranks],
            "findings": [f.as_dict() for f in verdict.findings],
        }

    def gpu_view(self, index: int) -> dict[str, Any]:
        """What GET /v1/gpus/{index} shows of this GPU's ranks (from NVML, environ and reports) and findings."""
        with self._lock:
            ranks, verdict = list(self._ranks), self._verdict
        return {
            "ranks": [_rank_json(r) for r in ranks if r.gpu == index],
            "trainer_findings": [f.as_dict() for f in verdict.findings if f.index == index],
        }

    def add_routes(self, app: FastAPI, require_token: Callable[..., None]) -> None:
        """GET /v1/incidents and GET /v1/trainers (read-only: no token)."""

        @app.get("/v1/incidents")
        def incidents(limit: int = 100) -> dict[str, Any]:
            return {"incidents": self.store.incidents(limit=max(1, min(limit, 1000)))}

        @app.get("/v1/trainers")
        def trainers() -> dict[str, Any]:
            return self.trainers()

    def collect(self) -> Iterator[Metric]:
        """The trainer and incident families (DESIGN.md conventions; labels gpu, uuid, rank, job)."""
        with self._lock:
            ranks, verdict, total, last = list(self._ranks), self._verdict, self._incidents_total, self._last_incident
        frag = GaugeMetricFamily(
            "gpuwatch_trainer_memory_fragmentation_ratio",
            "(reserved - allocated) / reserved of the rank's CUDA caching allocator.",
            labels=LABELS,
        )
        step = GaugeMetricFamily(
            "gpuwatch_trainer_step_time_seconds", "Mean step time the rank reports.", labels=LABELS
        )
        retries = CounterMetricFamily(
            "gpuwatch_trainer_alloc_retries",
            "cudaMalloc retries after a cache flush (num_alloc_retries).",
            labels=LABELS,
        )
        straggler = GaugeMetricFamily(
            "gpuwatch_trainer_straggler",
            "1 when the rank's step time is trainer.straggler_ratio above its peers' median; gpu_throttling: a fault "
            "reason bit is active on its GPU.",
            labels=[*LABELS, "gpu_throttling"],
        )
        seen: set[tuple[str, ...]] = set()
        checks = {c.trainer.pid: c for c in verdict.stragglers}
        for rank in ranks:
            labels = _labels(rank)
            if labels in seen:
                continue  # two unnamed processes on one GPU: one series, never a duplicate
            seen.add(labels)
            info = rank.info
            ratio = trainer_rules.fragmentation_ratio(info)
            if ratio is not None:
                frag.add_metric(list(labels), ratio)
            if info.step_time_s is not None:
                step.add_metric(list(labels), info.step_time_s)
            if info.num_alloc_retries is not None:
                retries.add_metric(list(labels), info.num_alloc_retries)
            check = checks.get(info.pid)
            if check is not None:
                straggler.add_metric([*labels, "true" if check.throttling else "false"], int(check.straggler))
        yield from (frag, step, straggler, retries)
        variance = GaugeMetricFamily(
            "gpuwatch_trainer_grad_norm_variance",
            "Variance of the job's gradient norm over its last 100 steps.",
            labels=["job_id"],
        )
        for job, value in _job_variances(ranks).items():
            variance.add_metric([job], value)
        yield variance
        yield CounterMetricFamily("gpuwatch_incidents", "Quarantines handled as incidents (stored).", value=total)
        for name, key, text in (
            ("gpuwatch_incident_time_to_stop_seconds", "time_to_stop_s", "decision to the last rank gone"),
            ("gpuwatch_incident_time_to_resume_seconds", "time_to_resume_s", "decision to the first step resumed"),
            ("gpuwatch_incident_steps_lost", "steps_lost", "steps redone after the resume"),
        ):
            family = GaugeMetricFamily(name, f"Latest incident with trainers: {text}.")
            if last is not None and last.get(key) is not None:
                family.add_metric([], float(last[key]))
            yield family


def _pids(targets: Iterable[_Target]) -> str:
    return ", ".join(
        f"pid {t.rank.pid}" + (f" (rank {t.rank.info.rank})" if t.rank.info.rank is not None else "") for t in targets
    )


def _labels(rank: Rank) -> tuple[str, str, str, str]:
    info = rank.info
    gpu = "" if rank.gpu is None else str(rank.gpu)
    return gpu, info.gpu_uuid or "", "" if info.rank is None else str(info.rank), info.job_id or ""


def _job_variances(ranks: Sequence[Rank]) -> dict[str, float]:
    """Per job, the lowest rank's grad-norm variance (DDP ranks all-reduce gradients: they agree)."""
    values: dict[str, tuple[int, float]] = {}
    for rank in ranks:
        info = rank.info
        if info.grad_norm_var is None:
            continue
        order = info.rank if info.rank is not None else 1 << 30
        job = info.job_id or ""
        if job not in values or order < values[job][0]:
            values[job] = (order, info.grad_norm_var)
    return {job: value for job, (_, value) in values.items()}


_INFO_FIELDS = tuple(f.name for f in fields(TrainerInfo))


def _rank_json(rank: Rank) -> dict[str, Any]:
    body = {name: getattr(rank.info, name) for name in _INFO_FIELDS if getattr(rank.info, name) is not None}
    ratio = trainer_rules.fragmentation_ratio(rank.info)
    return {
        **body,
        "gpu": rank.gpu,
        "sources": list(rank.sources),
        **({"fragmentation_ratio": ratio} if ratio is not None else {}),
    }
