"""Remediation: stop a job when its GPU is taken, a rank dies, its GPU faults or it hangs; see it resume.

A monitor listener (`on_publish`, on the sampling thread, never waiting) maps ranks to GPUs,
judges the trainers and hands what must be done to ONE remediation thread. That thread:

1. watches every rank's process (a pidfd each) and learns at once when one ends; a rank whose last
   report does not say it ended cleanly (`ended` null or "error", gpuwatch.trainer.contract) died,
   and the rest of its job on this node is stopped (`rank_died`, or `gpu_fault` when its GPU shows
   an XID/ECC/lost-GPU finding) before its peers hang in a collective;
2. stops jobs (a quarantine, a fault event on a GPU with ranks, a hung job): the stop signal to every
   rank of the job on this node, SIGTERM after `grace_period_s`, SIGKILL after `kill_after_s`;
3. watches for the job's relaunch: the first report of a new process of the job that carries a
   step, whose `first_step - 1` is the step it resumed from (gpuwatch.trainer.TrainerLink writes its
   first report at once and its last one on exit, so a short relaunch is seen too).

One thread, whatever the number of incidents: a stop or a resume watch is state, not a thread, and
at most one resume watch per job is kept (the newest), MAX_WATCHES in all.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.health import trainer_rules
from gpuwatch.health.state import Decision
from gpuwatch.model import Finding, GpuStatus, Snapshot
from gpuwatch.procfs import ProcFs
from gpuwatch.ranks import PID_BACKENDS, Rank, map_ranks
from gpuwatch.remediation.exits import ExitWatch
from gpuwatch.remediation.incidents import Incident, IncidentBook, Target
from gpuwatch.remediation.judging import TrainerJudge
from gpuwatch.remediation.stopping import JobStop
from gpuwatch.runtime import Report, RuntimeDir
from gpuwatch.store import Store
from gpuwatch.trainer.contract import ENDED_ERROR

log = logging.getLogger("gpuwatch.remediation")

IDLE_WAIT_S = 1.0  # the thread's longest sleep when nothing is due
STOP_POLL_S = 0.05  # how often a stop looks at its ranks besides their exits
REPORT_POLL_S = 0.1  # how often stops and resume watches re-read the reports
FAST_WATCH_S = 600.0  # a resume within this is timed to REPORT_POLL_S; later ones to SLOW_POLL_S
SLOW_POLL_S = 5.0
RESUME_WATCH_S = 6 * 3600.0  # a job not back by then is not coming back through this node
MAX_WATCHES = 64
MAX_ACCOUNTED = 4096  # ranks whose end is handled, remembered against stale publishes; gone ones dropped beyond
FAULT_RULES = frozenset(
    {"xid_critical", "xid_app", "xid_app_repeated", "ecc_uncorrectable", "gpu_lost", "gpu_reset_required"}
)
FAULT_LATE_S = 10.0  # a fault finding this soon after a rank died makes the death a gpu_fault


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


@dataclass(frozen=True)
class _Publish:
    """What one publish hands the remediation thread."""

    snapshot: Snapshot
    ranks: tuple[Rank, ...]
    decisions: tuple[Decision, ...]
    new_faults: tuple[Finding, ...]
    hung: tuple[tuple[Finding, tuple[Rank, ...]], ...]


class Remediation:
    """Stops jobs, records incidents, and judges and exports the trainers' reports."""

    def __init__(
        self, config: Config, store: Store, runtime: RuntimeDir, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.cfg = config.trainer
        self.runtime = runtime
        self.clock = clock
        self.proc = ProcFs()
        self.stop_signal = parse_signal(self.cfg.stop_signal)
        self.incidents = IncidentBook(store)
        self._judge = TrainerJudge(self.cfg, self.proc)
        self._lock = threading.Lock()
        self._version = 0
        self._ranks: list[Rank] = []
        self._verdict = trainer_rules.Verdict((), ())
        self._faults_seen: set[tuple[int, str]] = set()
        self._xids_seen: dict[int, int] = {}
        self._hangs_seen: set[str] = set()
        # Owned by the remediation thread:
        self._inbox: queue.SimpleQueue[_Publish] = queue.SimpleQueue()
        self._exits = ExitWatch(self.proc)
        self._known: dict[int, Rank] = {}
        self._accounted: dict[int, int | None] = {}  # pid → start time of ranks stopped or seen ending
        self._last: _Publish | None = None
        self._stops: list[JobStop] = []
        self._watches: dict[str, Incident] = {}  # job → the incident whose resume is awaited
        self._next_report_read = 0.0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-remediation", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the remediation thread (at daemon shutdown); stops in progress end where they are."""
        self._closed.set()
        self._exits.wake()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._exits.close()

    # -- the listener (sampling thread) ---------------------------------------------------------

    def on_publish(self, snapshot: Snapshot, decisions: list[Decision]) -> None:
        """After each publish: map and judge the ranks, hand stops to the remediation thread. Never waits.

        The monitor calls its listeners under its lock, so two calls never overlap.
        """
        ranks = map_ranks(snapshot.gpus, list(snapshot.trainers), self.proc, use_pids=snapshot.backend in PID_BACKENDS)
        judgement = self._judge.judge(snapshot, ranks)
        with self._lock:
            self._ranks, self._verdict = ranks, judgement.verdict
            self._version += 1
        hung = []
        for job, (finding, members) in judgement.hung.items():
            if job not in self._hangs_seen and self.cfg.restart_hung_jobs:
                hung.append((finding, members))
        self._hangs_seen = set(judgement.hung)
        self._inbox.put(_Publish(snapshot, tuple(ranks), tuple(decisions), self._new_faults(snapshot), tuple(hung)))
        self._exits.wake()

    def _new_faults(self, snapshot: Snapshot) -> tuple[Finding, ...]:
        """Fault findings (XID, ECC, lost GPU) that a new fault raised since the last publish.

        A finding is new when it was not active before, or, for an XID rule that stays active for
        its window, when the GPU's XID count grew: a relaunch on a GPU whose old XID is still in the
        window is not stopped again for it.
        """
        new = []
        active: set[tuple[int, str]] = set()
        for gpu in snapshot.gpus:
            xids = sum(count for _, count in gpu.xid_counts)
            more_xids = xids > self._xids_seen.get(gpu.index, xids)
            self._xids_seen[gpu.index] = xids
            for finding in gpu.findings:
                if finding.rule not in FAULT_RULES:
                    continue
                active.add((gpu.index, finding.rule))
                if (gpu.index, finding.rule) not in self._faults_seen or (more_xids and finding.rule.startswith("xid")):
                    new.append(finding)
        self._faults_seen = active
        return tuple(new)

    # -- the remediation thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                exited = self._exits.wait(self._timeout())
                while True:
                    try:
                        self._handle_publish(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for pid in exited:
                    self._on_exit(pid)
                reports = self._due_reports()
                self._advance_stops(reports or [])
                if reports is not None:
                    self._check_resumes(reports)
            except Exception:  # a bug here must not end stopping for good
                log.exception("remediation step failed")
                self._closed.wait(IDLE_WAIT_S)

    def _timeout(self) -> float:
        if self._stops:
            return STOP_POLL_S
        if self._watches:
            return max(0.0, min(IDLE_WAIT_S, self._next_report_read - time.monotonic()))
        return IDLE_WAIT_S

    def _handle_publish(self, publish: _Publish) -> None:
        self._last = publish
        if len(self._accounted) > MAX_ACCOUNTED:
            self._accounted = {pid: st for pid, st in self._accounted.items() if self.proc.alive(pid, st)}
        gone = []
        for rank in publish.ranks:
            if rank.pid in self._accounted and rank.start_time in (None, self._accounted[rank.pid]):
                continue  # a rank we stopped or saw end, in a publish made before that (or as it ended)
            if rank.pid not in self._known and not self._exits.add(rank.pid, rank.start_time):
                gone.append(rank.pid)  # it ended between the publish and now: an exit like any other
            self._known[rank.pid] = rank
        for decision in publish.decisions:
            if decision.kind == "quarantine":
                self._stop_for_quarantine(decision, publish)
        for fault in publish.new_faults:
            self._stop_for_fault(fault, publish)
            self._reclassify_deaths(fault)
        for pid in gone:
            self._on_exit(pid)
        for finding, members in publish.hung:
            job = members[0].job or ""
            self._start(
                "trainer_hang", "trainer_hang", finding.reason, finding.index, publish.snapshot.t, [*members], [job]
            )

    def _stop_for_quarantine(self, decision: Decision, publish: _Publish) -> None:
        on_gpu = [r for r in publish.ranks if r.gpu == decision.index]
        fault = next((f for f in _gpu(publish.snapshot, decision.index).findings if f.rule in FAULT_RULES), None)
        kind = "gpu_fault" if fault is not None and on_gpu else "quarantine"
        self._start(
            kind,
            decision.reason,
            decision.reason,
            decision.index,
            decision.t,
            self._with_peers(on_gpu),
            sorted({r.job for r in on_gpu if r.job}),
            auto=decision.auto,
            drill=decision.drill,
            always=True,
        )

    def _stop_for_fault(self, fault: Finding, publish: _Publish) -> None:
        on_gpu = [r for r in publish.ranks if r.gpu == fault.index]
        if on_gpu:
            jobs = sorted({r.job for r in on_gpu if r.job})
            self._start("gpu_fault", "gpu_fault", fault.reason, fault.index, fault.t, self._with_peers(on_gpu), jobs)

    def _with_peers(self, ranks: list[Rank]) -> list[Rank]:
        """The ranks, and every other rank of their jobs on this node run by the same users."""
        jobs, users = {r.job for r in ranks if r.job}, {r.uid for r in ranks}
        peers = [r for r in self._known.values() if r.job in jobs and r.uid in users and r not in ranks]
        return [*ranks, *sorted(peers, key=lambda r: r.pid)]

    def _start(
        self,
        kind: str,
        cause: str,
        reason: str,
        gpu: int | None,
        t: float,
        ranks: list[Rank],
        jobs: list[str],
        *,
        dead: list[Target] | None = None,
        auto: bool = True,
        drill: bool = False,
        always: bool = False,
    ) -> Incident | None:
        """Open an incident and stop its ranks, unless (`always` aside) every rank is being stopped already."""
        stopping = {t.rank.pid for stop in self._stops for t in stop.incident.targets}
        targets = [Target(r, r.gpu == gpu) for r in ranks if r.pid not in stopping and not self._has_ended(r)]
        if not targets and not dead and not always:
            return None
        status = self._last.snapshot.gpu(gpu) if self._last is not None and gpu is not None else None
        incident = Incident(
            kind=kind,
            gpu=gpu,
            uuid=status.uuid if status is not None else "",
            cause=cause,
            reason=reason,
            t=t,
            seen_mono=time.monotonic(),
            seen_lag_s=max(0.0, self.clock() - t),
            jobs=frozenset(jobs),
            targets=[*(dead or []), *targets],
            auto=auto,
            drill=drill,
            stop_signal=self.stop_signal.name,
            status="stopping" if targets else ("stopped" if dead else "no_trainers"),
        )
        for target in incident.targets:
            incident.see_step(target.rank.info.step)
            if target.ended is not None:
                incident.gone_pids.add(target.rank.pid)
        if not targets:
            incident.time_to_stop_s = 0.0 if not dead else incident.since_decision()
        self.incidents.save(incident)
        if targets:
            for target in targets:  # the stop's now: its exits are how it ended, not deaths
                self._known.pop(target.rank.pid, None)
                self._exits.remove(target.rank.pid)
                self._accounted[target.rank.pid] = target.rank.start_time
            self._stops.append(JobStop(incident, self.cfg, self.stop_signal, self.proc))
        self._watch(incident)
        return incident

    def _has_ended(self, rank: Rank) -> bool:
        """The rank's link already said how it ended (it is on its way out): it is no one to signal."""
        if "report" not in rank.sources:
            return False
        report = self.runtime.read_report(rank.pid)
        return report is not None and report.info.ended is not None

    def _on_exit(self, pid: int) -> None:
        """A rank's process ended: a clean end is nothing to do; a death stops the rest of its job."""
        rank = self._known.pop(pid, None)
        if rank is None:
            return
        self._accounted[pid] = rank.start_time
        report = self.runtime.read_report(pid)
        if report is None:
            return  # no last word (a rank without TrainerLink): how it ended is unknown, torchrun will tell
        ended = report.info.ended
        if ended is not None and ended != ENDED_ERROR:
            return
        how = "died" if ended is None else "raised"
        log.warning(
            "rank %s (pid %d) of job %s on GPU %s %s at step %s",
            rank.info.rank,
            pid,
            rank.job,
            rank.gpu,
            "vanished without a last report" if ended is None else "ended with an error",
            report.info.step,
        )
        dead = Target(dataclasses.replace(rank, info=report.info), True, how)
        status = _gpu(self._last.snapshot, rank.gpu) if self._last is not None and rank.gpu is not None else None
        fault = next((f for f in status.findings if f.rule in FAULT_RULES), None) if status is not None else None
        kind = "gpu_fault" if fault is not None else "rank_died"
        reason = fault.reason if fault is not None else f"rank {rank.info.rank} (pid {pid}) {how}"
        peers = [r for r in self._with_peers([rank]) if r.pid != pid]
        self._start(kind, kind, reason, rank.gpu, self.clock(), peers, [rank.job] if rank.job else [], dead=[dead])

    def _reclassify_deaths(self, fault: Finding) -> None:
        """A rank that died just before its GPU's XID or ECC event was judged died of the fault."""
        for incident in [*(s.incident for s in self._stops), *self._watches.values()]:
            if (
                incident.kind == "rank_died"
                and incident.gpu == fault.index
                and abs(fault.t - incident.t) < FAULT_LATE_S
            ):
                incident.kind = incident.cause = "gpu_fault"
                incident.reason = fault.reason
                self.incidents.save(incident)

    def _due_reports(self) -> list[Report] | None:
        """The trainers' reports when a read is due (stops and fresh watches: every REPORT_POLL_S), else None."""
        now = time.monotonic()
        if not (self._stops or self._watches) or now < self._next_report_read:
            return None
        fast = self._stops or any(now - i.seen_mono < FAST_WATCH_S for i in self._watches.values())
        self._next_report_read = now + (REPORT_POLL_S if fast else SLOW_POLL_S)
        return self.runtime.read_reports()

    def _advance_stops(self, reports: list[Report]) -> None:
        """Note the steps the stopping ranks report, escalate, and close the stops that are done."""
        for stop in list(self._stops):
            incident = stop.incident
            pids = {t.rank.pid for t in incident.targets}
            for report in reports:
                if report.info.pid in pids:
                    incident.see_step(report.info.step)
            if stop.advance():
                self._stops.remove(stop)
                for target in incident.targets:  # the last reports: the steps they stopped at
                    last = self.runtime.read_report(target.rank.pid)
                    incident.see_step(last.info.step if last is not None else None)
                stopped = all(t.ended != "running" for t in incident.targets)
                incident.status = "stopped"
                incident.time_to_stop_s = incident.since_decision() if stopped else None
                self.incidents.save(incident)
                log.warning(
                    "GPU %s: job %s stopped in %s s, last step %s: %s",
                    incident.gpu,
                    ",".join(sorted(incident.jobs)) or "-",
                    incident.time_to_stop_s,
                    incident.last_step,
                    [t.as_dict() for t in incident.targets],
                )

    def _watch(self, incident: Incident) -> None:
        """Await the incident's resume; a newer incident of the same job takes its place."""
        for job in incident.jobs:
            self._watches[job] = incident
        while len(self._watches) > MAX_WATCHES:
            job = min(self._watches, key=lambda j: self._watches[j].seen_mono)
            self._end_watch(self._watches[job], "not_resumed")

    def _check_resumes(self, reports: list[Report]) -> None:
        """End each watch whose job runs again (a new process of it reports a step), or that waited too long."""
        now = time.monotonic()
        for incident in {id(i): i for i in self._watches.values()}.values():
            if incident.status == "stopping":
                continue  # its own ranks are still going
            relaunched = [
                r.info
                for r in reports
                if r.info.job_id in incident.jobs
                and r.info.pid not in incident.gone_pids
                and r.info.step is not None
                and (r.info.updated_t or 0.0) >= incident.t
            ]
            if relaunched:
                first = min(relaunched, key=lambda r: (r.updated_t or 0.0, r.step or 0))
                starts = [r.first_step - 1 if r.first_step is not None else r.step or 0 for r in relaunched]
                incident.resumed_step = max(0, min(starts))
                incident.time_to_resume_s = round((first.updated_t or 0.0) - incident.t, 3)
                if incident.last_step is not None:
                    incident.steps_lost = max(0, incident.last_step - incident.resumed_step)
                log.warning(
                    "job %s resumed at step %d, %.1f s after the %s on GPU %s (%s step(s) lost)",
                    ",".join(sorted(incident.jobs)),
                    incident.resumed_step,
                    incident.time_to_resume_s,
                    incident.kind,
                    incident.gpu,
                    incident.steps_lost,
                )
                self._end_watch(incident, "resumed")
            elif now - incident.seen_mono > RESUME_WATCH_S:
                self._end_watch(incident, "not_resumed")

    def _end_watch(self, incident: Incident, status: str) -> None:
        incident.status = status
        self.incidents.save(incident)
        for job in [job for job, watched in self._watches.items() if watched is incident]:
            del self._watches[job]

    # -- serving --------------------------------------------------------------------------------

    def version(self) -> object:
        """Changes whenever what the collector yields may have changed (the metrics render cache key)."""
        return (self._version, self.incidents.version)

    def ranks(self) -> tuple[list[Rank], trainer_rules.Verdict]:
        """The ranks of the last publish and their verdict."""
        with self._lock:
            return list(self._ranks), self._verdict


def _gpu(snapshot: Snapshot, index: int) -> GpuStatus:
    status = snapshot.gpu(index)
    if status is None:
        raise KeyError(index)
    return status
