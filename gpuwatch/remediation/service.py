"""Remediation: stop a job when its GPU is taken, a rank dies, its GPU faults or it hangs; see it resume.

A monitor listener (`on_publish`, on the sampling thread, never waiting) maps ranks to GPUs,
judges the trainers and hands what must be done to ONE remediation thread. That thread:

1. watches every rank's process (a pidfd each) and learns at once when one ends; a rank whose last
   report does not say it ended cleanly (`ended` null or "error", gpuwatch.trainer.contract) died,
   and the rest of its job on this node is stopped: `gpu_fault` when an XID named its pid or a
   GPU-wide fault hit its GPU as it died, else `rank_died` (a finding left on the GPU by an older
   fault is no cause);
2. stops jobs for a quarantine, a fault that is news (gpuwatch.remediation.faults: it acts once,
   on the jobs it can have hurt) or a hung job: the stop signal to every rank of the job on this
   node, SIGTERM after `grace_period_s`, SIGKILL after `kill_after_s`; a job whose ranks recover
   in place loses only the ranks that must leave, and its survivors go on;
3. watches for the job to take its next step (gpuwatch.remediation.resumes);
4. looks for hung jobs every HANG_POLL_S with the reports and step pages as they are then, so a
   stopped or frozen rank is found in seconds whatever the sampling interval.

A job is (uid, job id) everywhere: its peers, its hang, its incidents and its resume are never
another user's, whatever job id they chose. One thread, whatever the number of incidents.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuwatch.base.procfs import ProcFs
from gpuwatch.base.sourcelog import SourceLog
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.health import trainer_rules
from gpuwatch.health.state import Decision
from gpuwatch.model import Snapshot
from gpuwatch.node.ranks import PID_BACKENDS, JobKey, Rank, map_ranks
from gpuwatch.node.runtime import Report, RuntimeDir
from gpuwatch.node.store import Store
from gpuwatch.remediation.exits import ExitWatch
from gpuwatch.remediation.faults import STARTED_SLACK_S, Fault, FaultTracker
from gpuwatch.remediation.incidents import PATH_IN_PLACE, PATH_RELAUNCH, Incident, IncidentBook, Target
from gpuwatch.remediation.judging import Hang, TrainerJudge
from gpuwatch.remediation.onset import death_onset
from gpuwatch.remediation.resumes import ResumeWatches
from gpuwatch.remediation.stopping import JobStop
from gpuwatch.trainer.contract import ENDED_ERROR

log = logging.getLogger("gpuwatch.remediation")

IDLE_WAIT_S = 1.0  # the thread's longest sleep when nothing is due
STOP_POLL_S = 0.05  # how often a stop looks at its ranks besides their exits
PENDING_POLL_S = 0.2  # how often an application XID waiting for its pid is looked at
REPORT_POLL_S = 0.1  # how often stops and resume watches re-read the reports
FAST_WATCH_S = 600.0  # a resume within this is timed to REPORT_POLL_S; later ones to SLOW_POLL_S
SLOW_POLL_S = 5.0
UNPUBLISHED_DEATH_S = 10.0  # a report of a process never published that ended this recently is a death to act on
STOPPED_VERDICT_SLACK_S = 0.01  # judged this long after a stopped rank's limit: past it, never just short of it
HANG_POLL_S = 0.5  # how often the ranks' progress is judged between publishes (only while there are ranks)
MAX_ACCOUNTED = 4096  # ranks whose end is handled, remembered against stale publishes; gone ones dropped beyond
FAULT_LATE_S = 10.0  # a fault this close to a rank's death is what it died of
_ANCESTRY_DEPTH = 16  # parents walked up from a faulting pid to find the rank it belongs to


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
    hung: tuple[Hang, ...]


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
        self._hangs_seen: set[JobKey] = set()
        self._hangs_polled: set[JobKey] = set()  # the remediation thread's own, for hangs()
        self._next_hang_poll = 0.0
        # Owned by the remediation thread:
        self._inbox: queue.SimpleQueue[_Publish] = queue.SimpleQueue()
        self._exits = ExitWatch(self.proc)
        self._faults = FaultTracker(clock())
        self._recent: deque[Fault] = deque(maxlen=256)  # faults that were news, for what the next deaths died of
        self._ended: deque[Rank] = deque(maxlen=256)  # ranks whose death was seen, for a fault that names them late
        self._known: dict[int, Rank] = {}
        self._accounted: dict[int, int | None] = {}  # pid → start time of ranks stopped or seen ending
        self._last: _Publish | None = None
        self._stops: list[JobStop] = []
        self._watches = ResumeWatches(self._end_watch)
        self._say = SourceLog(log)
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
        hung = [h for job, h in judgement.hung.items() if job not in self._hangs_seen and self.cfg.restart_hung_jobs]
        self._hangs_seen = set(judgement.hung)
        self._inbox.put(_Publish(snapshot, tuple(ranks), tuple(decisions), tuple(hung)))
        self._exits.wake()

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
                for fault in self._faults.overdue():
                    self._recent.append(fault)
                    self._act_on(fault)
                for pid in exited:
                    self._on_exit(pid)
                self._poll_hangs()
                reports = self._due_reports()
                self._advance_stops(reports or [])
                if reports is not None:
                    self._watches.check(reports)
            except Exception:  # a bug here must not end stopping for good
                log.exception("remediation step failed")
                self._closed.wait(IDLE_WAIT_S)

    def _timeout(self) -> float:
        if self._stops:
            return STOP_POLL_S
        if self._faults.waiting():
            return PENDING_POLL_S
        wait = min(IDLE_WAIT_S, self._next_hang_poll - time.monotonic())
        if self._watches:
            wait = min(wait, self._next_report_read - time.monotonic())
        return max(0.0, wait)

    def _handle_publish(self, publish: _Publish) -> None:
        if len(self._accounted) > MAX_ACCOUNTED:
            self._accounted = {pid: st for pid, st in self._accounted.items() if self.proc.alive(pid, st)}
        gone = []
        ranks = []
        for rank in publish.ranks:
            known = self._known.get(rank.pid)
            if known is not None and rank.start_time in (None, known.start_time):  # None: exiting, /proc unreadable
                # What it ran when first seen (an exec is no rank), and when it started.
                rank = dataclasses.replace(rank, exe=known.exe, start_time=known.start_time)
                if "report" in known.sources and "report" not in rank.sources:
                    # A dying rank NVML still lists, its report gone: its last report stands (how its job recovers).
                    rank = dataclasses.replace(rank, info=known.info)
            ranks.append(rank)
            if self._accounted_for(rank):
                continue  # a rank we stopped or saw end, in a publish made before that (or as it ended)
            if rank.pid not in self._known and not self._exits.add(rank.pid, rank.start_time):
                gone.append(rank.pid)  # it ended between the publish and now: an exit like any other
            self._known[rank.pid] = rank
        publish = dataclasses.replace(publish, ranks=tuple(ranks))
        self._last = publish
        news = self._faults.news(publish.snapshot)
        self._recent.extend(news)  # first: a quarantine the same fault decided is a gpu_fault
        for decision in publish.decisions:
            if decision.kind == "quarantine":
                self._stop_for_quarantine(decision, publish)
        for fault in news:
            self._act_on(fault)
        for pid in gone:
            self._on_exit(pid)
        for hang in publish.hung:
            self._stop_for_hang(hang)

    def _poll_hangs(self) -> None:
        """Judge the known ranks' progress now (their reports and step pages), and stop a job newly hung."""
        now_mono = time.monotonic()
        if self._last is None or now_mono < self._next_hang_poll:
            return
        self._next_hang_poll = now_mono + HANG_POLL_S
        every = self.runtime.read_reports()
        self._deaths_unpublished(every)
        reports = [r.info for r in every if r.running]
        if not reports and not self._known:
            return
        snapshot = self._last.snapshot
        mapped = map_ranks(snapshot.gpus, reports, self.proc, use_pids=snapshot.backend in PID_BACKENDS)
        ranks = [r for r in mapped if not self._accounted_for(r)]
        hung = self._judge.hangs(self.clock(), ranks, snapshot)
        due = self._judge.stopped_verdict_in(self.clock())  # a stopped rank's verdict falls due before the next poll
        if due is not None:
            self._next_hang_poll = min(self._next_hang_poll, now_mono + due + STOPPED_VERDICT_SLACK_S)
        new = [h for job, h in hung.items() if job not in self._hangs_polled and self.cfg.restart_hung_jobs]
        self._hangs_polled = set(hung)
        for hang in new:
            self._stop_for_hang(hang)

    def _deaths_unpublished(self, reports: list[Report]) -> None:
        """A rank that died before a publish listed it (killed within a second of its start) left only its report:
        one that said no end, fresh, of a pid never known, is a death like one seen."""
        now = self.clock()
        for report in reports:
            info = report.info
            if report.alive or info.ended is not None or info.pid in self._known or info.pid in self._accounted:
                continue
            if now - (info.updated_t or 0.0) > UNPUBLISHED_DEATH_S:
                continue  # an old report (the daemon started after it): not news
            assert self._last is not None
            snapshot = self._last.snapshot
            for rank in map_ranks(snapshot.gpus, [info], self.proc, use_pids=False):
                self._known[rank.pid] = rank
                self._on_exit(rank.pid)

    # -- what starts a stop ---------------------------------------------------------------------

    def _stop_for_quarantine(self, decision: Decision, publish: _Publish) -> None:
        on_gpu = [r for r in publish.ranks if r.gpu == decision.index]
        fault = self._recent_fault(decision.index, decision.t)
        kind = "gpu_fault" if fault is not None and on_gpu else "quarantine"
        self._start(
            kind,
            decision.reason,
            decision.reason,
            decision.index,
            self._targets(on_gpu),
            began_t=fault.t if kind == "gpu_fault" and fault is not None else decision.t,
            t=decision.t,
            auto=decision.auto,
            drill=decision.drill,
            always=True,
        )

    def _act_on(self, fault: Fault) -> None:
        """Stop the jobs a fault that is news can have hurt: its pid's job, or the ranks that were on its GPU."""
        ranks = list(self._known.values())
        if fault.app and not fault.pid_unknown:
            owner = self._owner(fault.pid, [*ranks, *self._ended])
            if owner is None:
                self._say.say(
                    fault.gpu, logging.WARNING, "GPU %d: %s, which is no rank of a job here: nothing stopped",
                    fault.gpu, fault.reason,
                )  # fmt: skip
            elif owner.pid not in self._known:
                self._reclassify_deaths(fault)  # its rank ended already: the death is the fault's
            else:
                reason = f"{fault.reason} (rank {owner.info.rank} of job {owner.job})"
                self._start("gpu_fault", "gpu_fault", reason, fault.gpu, self._targets([owner]), began_t=fault.t)
            return
        hurt = [r for r in ranks if r.gpu == fault.gpu and _started_before(r, fault.t)]
        if hurt:
            self._start("gpu_fault", "gpu_fault", fault.reason, fault.gpu, self._targets(hurt), began_t=fault.t)
        self._reclassify_deaths(fault)

    def _stop_for_hang(self, hang: Hang) -> None:
        """A hung job: all its ranks here, or, where it recovers in place, only the frozen ones (SIGKILL)."""
        members = list(hang.members)
        stopped = [r for r in hang.frozen if self.proc.run_state(r.pid) in {"T", "t"}] or list(hang.frozen)
        in_place = all(r.in_place for r in members) and 0 < len(stopped) < len(members)
        finding = hang.finding
        self._start(
            "trainer_hang",
            "trainer_hang",
            finding.reason,
            finding.index if finding.index >= 0 else None,
            stopped if in_place else members,
            began_t=hang.last_step_t,
            t=finding.t,
            path=PATH_IN_PLACE if in_place else PATH_RELAUNCH,
            kill_at_once=in_place,
        )

    def _on_exit(self, pid: int) -> None:
        """A rank's process ended: a clean end is nothing to do; a death stops the rest of its job."""
        rank = self._known.pop(pid, None)
        if rank is None:
            return
        self._accounted[pid] = rank.start_time
        self._ended.append(rank)
        report = self.runtime.read_report(pid)
        if report is None:
            return  # no last word (a rank without TrainerLink): how it ended is unknown, torchrun will tell
        ended = report.info.ended
        if ended is not None and ended != ENDED_ERROR:
            return
        how = "died" if ended is None else "raised"
        now = self.clock()
        rank = dataclasses.replace(rank, info=report.info)  # its own last word: its job, and how that job recovers
        log.warning(
            "rank %s (pid %d) of job %s on GPU %s %s at step %s",
            rank.info.rank,
            pid,
            rank.job,
            rank.gpu,
            "vanished without a last report" if ended is None else "ended with an error",
            report.info.step,
        )
        dead = Target(rank, True, how)
        cause = self._cause_of_death(rank, now)
        kind = "gpu_fault" if cause is not None else "rank_died"
        reason = cause.reason if cause is not None else f"rank {rank.info.rank} (pid {pid}) {how}"
        peers = [r for r in self._targets([rank]) if r.pid != pid]
        in_place = rank.in_place and self._survivors(rank)
        self._start(
            kind,
            kind,
            reason,
            rank.gpu,
            [] if in_place else peers,
            began_t=cause.t if cause is not None else death_onset(report.info, now, report.exit_t),
            t=now,
            dead=[dead],
            path=PATH_IN_PLACE if in_place else PATH_RELAUNCH,
        )

    # -- whom a fault hurt ----------------------------------------------------------------------

    def _targets(self, ranks: list[Rank]) -> list[Rank]:
        """The ranks, and every other rank here of their jobs (same uid and job id), but where a job
        recovers in place: then only the ranks that must leave."""
        jobs = {r.job_key for r in ranks if r.job_key is not None and not r.in_place}
        peers = [r for r in self._known.values() if r.job_key in jobs and r not in ranks]
        return [*ranks, *sorted(peers, key=lambda r: r.pid)]

    def _survivors(self, leaving: Rank) -> bool:
        """Whether the leaving rank's job keeps ranks (here, or elsewhere: a larger world) to go on with."""
        here = [r for r in self._known.values() if r.job_key == leaving.job_key and r.pid != leaving.pid]
        return bool(here) or (leaving.info.world_size or 1) > 1

    def _owner(self, pid: int | None, ranks: Iterable[Rank]) -> Rank | None:
        """The rank that `pid` is, or is a descendant of (a DataLoader worker, a subprocess of the rank)."""
        by_pid = {r.pid: r for r in ranks}
        for _ in range(_ANCESTRY_DEPTH):
            if pid is None:
                return None
            if pid in by_pid:
                return by_pid[pid]
            pid = self.proc.parent(pid)
        return None

    def _recent_fault(self, gpu: int, t: float) -> Fault | None:
        """A GPU-wide fault on `gpu` acted on within FAULT_LATE_S of `t`."""
        return next((f for f in self._recent if f.gpu == gpu and f.gpu_wide and abs(f.t - t) < FAULT_LATE_S), None)

    def _cause_of_death(self, rank: Rank, t: float) -> Fault | None:
        """An XID that named the rank's pid, or a GPU-wide fault on its GPU since it started, near its death."""
        for fault in reversed(self._recent):
            if abs(fault.t - t) >= FAULT_LATE_S:
                continue
            if fault.pid is not None and self._owner(fault.pid, [rank]) is rank:
                return fault
            if fault.gpu_wide and fault.gpu == rank.gpu and _started_before(rank, fault.t):
                return fault
        return None

    def _reclassify_deaths(self, fault: Fault) -> None:
        """A rank that died just before its fault was judged died of the fault (its XID named it, or its GPU)."""
        for incident in [*(s.incident for s in self._stops), *self._watches.incidents()]:
            if incident.kind != "rank_died" or abs(fault.t - incident.began) >= FAULT_LATE_S:
                continue
            dead = [t.rank for t in incident.targets if t.ended in {"died", "raised"}]
            named = fault.pid is not None and any(self._owner(fault.pid, [r]) is r for r in dead)
            wide = fault.gpu_wide and incident.gpu == fault.gpu and any(_started_before(r, fault.t) for r in dead)
            if named or wide:
                incident.kind = incident.cause = "gpu_fault"
                incident.reason = fault.reason
                incident.began_t = min(incident.began, fault.t)
                self._save(incident)

    # -- incidents and stops --------------------------------------------------------------------

    def _start(
        self, kind: str, cause: str, reason: str, gpu: int | None, ranks: list[Rank], **how: Any
    ) -> list[Incident]:
        """One incident per (uid, job) among `ranks` (and `dead`): a stop that hits several users' jobs is
        one record for each, with its own user, job, steps and resume. `how`: as `_start_one` takes it."""
        dead: list[Target] = how.pop("dead", None) or []
        groups: dict[tuple[int | None, str | None], tuple[list[Rank], list[Target]]] = {}
        for rank in ranks:
            groups.setdefault((rank.uid, rank.info.job_id), ([], []))[0].append(rank)
        for target in dead:
            groups.setdefault((target.rank.uid, target.rank.info.job_id), ([], []))[1].append(target)
        if len(groups) <= 1:
            return [i for i in [self._start_one(kind, cause, reason, gpu, ranks, dead=dead, **how)] if i is not None]
        started = [self._start_one(kind, cause, reason, gpu, rs, dead=ds, **how) for rs, ds in groups.values()]
        return [incident for incident in started if incident is not None]

    def _start_one(
        self,
        kind: str,
        cause: str,
        reason: str,
        gpu: int | None,
        ranks: list[Rank],
        *,
        began_t: float,
        t: float | None = None,
        dead: list[Target] | None = None,
        auto: bool = True,
        drill: bool = False,
        always: bool = False,
        path: str | None = None,
        kill_at_once: bool = False,
    ) -> Incident | None:
        """Open an incident and stop its ranks, unless (`always` aside) every rank is being stopped already."""
        stopping = {t.rank.pid for stop in self._stops for t in stop.incident.targets}
        targets = [
            Target(r, r.gpu == gpu)
            for r in ranks
            if r.pid not in stopping and not self._accounted_for(r) and not self._has_ended(r)
        ]
        if not targets and not dead and not always:
            return None
        now = self.clock()
        t = now if t is None else t
        status = self._last.snapshot.gpu(gpu) if self._last is not None and gpu is not None else None
        everyone = [*(d.rank for d in dead or []), *(tg.rank for tg in targets)]
        incident = Incident(
            kind=kind,
            gpu=gpu,
            uuid=status.uuid if status is not None else "",
            cause=cause,
            reason=reason,
            t=t,
            seen_mono=time.monotonic(),
            seen_lag_s=max(0.0, now - t),
            jobs=frozenset(r.job_key for r in everyone if r.job_key is not None),
            targets=[*(dead or []), *targets],
            began_t=began_t,
            path=path or self._path(targets, dead or []),
            auto=auto,
            drill=drill,
            stop_signal="SIGKILL" if kill_at_once else self.stop_signal.name,
            status="stopping" if targets else ("stopped" if dead else "no_trainers"),
        )
        for target in incident.targets:
            incident.see_step(self._last_step(target))
            if target.ended is not None:
                incident.gone_pids.add(target.rank.pid)
        if not targets:
            incident.time_to_stop_s = 0.0 if not dead else incident.since_decision()
            incident.stopped_t = now if dead else None
        recorded = self.incidents.allow(incident)
        if recorded:
            self.incidents.save(incident)
        else:
            self._say.say(
                incident.uid, logging.WARNING, "too many incidents of uid %s: %s not recorded", incident.uid, kind
            )
        if targets:
            for target in targets:  # the stop's now: its exits are how it ended, not deaths
                self._known.pop(target.rank.pid, None)
                self._exits.remove(target.rank.pid)
                self._accounted[target.rank.pid] = target.rank.start_time
            signal_now = signal.SIGKILL if kill_at_once else self.stop_signal
            self._stops.append(JobStop(incident, self.cfg, signal_now, self.proc))
        if recorded:
            self._watches.watch(incident, self.runtime.read_reports() if self._watches else None)
        return incident

    def _path(self, targets: list[Target], dead: list[Target]) -> str:
        """in_place when every job involved recovers in place and keeps ranks to go on with; else relaunch."""
        leaving = [t.rank for t in [*targets, *dead]]
        if not leaving or not all(r.in_place for r in leaving):
            return PATH_RELAUNCH
        return PATH_IN_PLACE if all(self._survivors(r) for r in leaving) else PATH_RELAUNCH

    def _last_step(self, target: Target) -> int | None:
        """The furthest step the rank finished, from its step page now (exact, even after a SIGKILL)."""
        report = self.runtime.read_report(target.rank.pid)
        steps = [s for s in (target.rank.info.step, report.info.step if report else None) if s is not None]
        return max(steps) if steps else None

    def _accounted_for(self, rank: Rank) -> bool:
        """A rank we stopped or saw end: a judgement made before that (a publish, a hang poll) names it in vain."""
        return rank.pid in self._accounted and rank.start_time in (None, self._accounted[rank.pid])

    def _has_ended(self, rank: Rank) -> bool:
        """The rank's link already said how it ended (it is on its way out): it is no one to signal."""
        if "report" not in rank.sources:
            return False
        report = self.runtime.read_report(rank.pid)
        return report is not None and report.info.ended is not None

    def _save(self, incident: Incident) -> None:
        """Store a change to a recorded incident (one over its user's budget was never recorded)."""
        if incident.id:
            self.incidents.save(incident)

    def _due_reports(self) -> list[Report] | None:
        """The trainers' reports when a read is due (stops and fresh watches: every REPORT_POLL_S), else None."""
        now = time.monotonic()
        if not (self._stops or self._watches) or now < self._next_report_read:
            return None
        fast = self._stops or any(now - i.seen_mono < FAST_WATCH_S for i in self._watches.incidents())
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
                for target in incident.targets:  # the last steps they finished (their step pages)
                    incident.see_step(self._last_step(target))
                stopped = all(t.ended != "running" for t in incident.targets)
                incident.status = "stopped" if incident.status == "stopping" else incident.status  # or interrupted
                incident.time_to_stop_s = incident.since_decision() if stopped else None
                incident.stopped_t = self.clock() if stopped else None
                if incident.id:
                    self.incidents.save(incident)
                log.warning(
                    "GPU %s: job %s stopped in %s s, last step %s: %s",
                    incident.gpu,
                    ",".join(sorted(job for _, job in incident.jobs)) or "-",
                    incident.time_to_stop_s,
                    incident.last_step,
                    [t.as_dict() for t in incident.targets],
                )

    def _end_watch(self, incident: Incident, status: str) -> None:
        incident.status = status
        self.incidents.save(incident)

    # -- serving --------------------------------------------------------------------------------

    def version(self) -> object:
        """Changes whenever what the collector yields may have changed (the metrics render cache key)."""
        return (self._version, self.incidents.version)

    def ranks(self) -> tuple[list[Rank], trainer_rules.Verdict]:
        """The ranks of the last publish and their verdict."""
        with self._lock:
            return list(self._ranks), self._verdict


def _started_before(rank: Rank, t: float) -> bool:
    """The rank's process was running when something happened at `t` (unknown start: assume it was)."""
    return rank.started_t is None or rank.started_t <= t + STARTED_SLACK_S
