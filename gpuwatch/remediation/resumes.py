"""Watching a stopped job come back, from its ranks' reports: when it finished its next step, from which step.

* relaunch: the first report of a new process of the same job (uid, job id) whose first step ended
  after the fault began; it resumed from `first_step - 1`, and its step page says when that first
  step ended (TrainerLink writes its first report at once and its last one on exit, so a short
  relaunch is seen too);
* in place: a process that started since (a spare in a lost rank's place), from its own first step;
  or a survivor (same pid) that finished, after the fault began, a step past `last_step + 1` (the lost
  rank finished at most `last_step`, so it took part in at most the next one). A survivor's page at or
  below that says nothing of the job's return: it may show the step in flight at the fault (collectives
  done before the kill, page written just after), or a sharded job's first step after its rollback,
  whose page the survivors write a few ms before the spare that took part in it writes its own. Such a
  survivor went on from the step before the first one seen past the bound, and that step's time is
  the next step's (to the report poll): a replicated job's return is timed at most one step late.
  With no `last_step` (the lost rank never finished a step) any step after the fault counts.

Either way the path becomes `spare` when a process that took its rank over as a warm spare (its
report's `spare`) brought the job back: it is the relaunch's new process, or, in place, its first
step was the job's first after the fault (a sharded job's survivors roll back and wait for it; a
replicated job's survivors go on without it, so it joins at a later step and the path stays in_place).

One watch per job (the newest incident), at most MAX_WATCHES_PER_UID per user and MAX_WATCHES in
all: a user with many incidents only ever ends their own oldest watches, never another user's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from gpuwatch.model import TrainerInfo
from gpuwatch.node.ranks import JobKey
from gpuwatch.remediation.incidents import PATH_IN_PLACE, PATH_SPARE, Incident
from gpuwatch.remediation.onset import launcher_onset
from gpuwatch.reports import Report

log = logging.getLogger("gpuwatch.remediation")

RESUME_WATCH_S = 6 * 3600.0  # a job not back by then is not coming back through this node
MAX_WATCHES_PER_UID = 16
MAX_WATCHES = 256


_went_on = {PATH_IN_PLACE: "went on in place", PATH_SPARE: "went on through a spare"}


class ResumeWatches:
    """The incidents whose job is awaited, by job; `end(incident, status)` records how each watch ended."""

    def __init__(self, end: Callable[[Incident, str], None]) -> None:
        self._end = end
        self._by_job: dict[JobKey, Incident] = {}

    def __bool__(self) -> bool:
        return bool(self._by_job)

    def incidents(self) -> list[Incident]:
        return list({id(i): i for i in self._by_job.values()}.values())

    def watch(self, incident: Incident, reports: list[Report] | None = None) -> None:
        """Await the incident's resume; a newer incident of the same job takes its place and ends the older's
        watch: `resumed` when `reports` (read as the newer fault was found) show the job came back in between,
        else `interrupted` (the job was hit again before it came back)."""
        older = {id(o): o for job in incident.jobs if (o := self._by_job.get(job)) not in (None, incident)}
        for job in incident.jobs:
            self._by_job[job] = incident
        for old in older.values():
            if all(watched is not old for watched in self._by_job.values()):
                self._end(old, "resumed" if reports is not None and self._back(old, reports) else "interrupted")
        for uid in {uid for uid, _ in incident.jobs}:
            while sum(1 for job in self._by_job if job[0] == uid) > MAX_WATCHES_PER_UID:
                self._give_up_oldest(uid)
        while len(self._by_job) > MAX_WATCHES:
            self._give_up_oldest(Counter(uid for uid, _ in self._by_job).most_common(1)[0][0])

    def check(self, reports: list[Report], now_mono: float | None = None) -> None:
        """End each watch whose job finished a step again, or that waited too long."""
        now_mono = time.monotonic() if now_mono is None else now_mono
        for incident in self.incidents():
            if incident.status == "stopping":
                continue  # its own ranks are still going
            launcher_onset(incident, reports)  # an exit note read since the incident opened dates the death
            if self._back(incident, reports):
                log.warning(
                    "job %s %s at step %d, %.1f s after the %s on GPU %s began (%s step(s) lost)",
                    ",".join(sorted(job for _, job in incident.jobs)),
                    _went_on.get(incident.path, "resumed"),
                    incident.resumed_step,
                    incident.time_to_resume_s,
                    incident.kind,
                    incident.gpu,
                    incident.steps_lost,
                )
                self.stop_watching(incident, "resumed")
            elif now_mono - incident.seen_mono > RESUME_WATCH_S:
                self.stop_watching(incident, "not_resumed")

    def stop_watching(self, incident: Incident, status: str) -> None:
        for job in [job for job, watched in self._by_job.items() if watched is incident]:
            del self._by_job[job]
        self._end(incident, status)

    def _back(self, incident: Incident, reports: list[Report]) -> bool:
        """Whether the reports show the incident's job finished a step after the fault (and note how)."""
        mine = [r for r in reports if (r.owner_uid, r.info.job_id) in incident.jobs and r.info.step is not None]
        if incident.path == PATH_IN_PLACE:
            return self._survivors_went_on(incident, mine)
        return self._relaunched(incident, mine)

    def _relaunched(self, incident: Incident, mine: list[Report]) -> bool:
        new = [
            r.info
            for r in mine
            if r.info.pid not in incident.gone_pids
            and r.info.pid not in {t.rank.pid for t in incident.targets}
            and (r.info.first_step_t or r.info.updated_t or 0.0) >= _fault_floor(incident)
        ]
        if not new:
            return False
        starts = [r.first_step - 1 if r.first_step is not None else r.step or 0 for r in new]
        incident.resumed(min(starts), min(r.first_step_t or r.updated_t or 0.0 for r in new))
        if any(r.spare for r in new):
            incident.path = PATH_SPARE
            incident.spare_stage = next((r.spare_stage for r in new if r.spare), None)
        return True

    def _survivors_went_on(self, incident: Incident, mine: list[Report]) -> bool:
        back = [
            r.info for r in mine if r.alive and r.info.pid not in incident.gone_pids and _shows_return(r.info, incident)
        ]
        if not back:
            return False
        firsts = [_first_after(r, incident) for r in back]
        incident.resumed(min(step for step, _ in firsts) - 1, min(t for _, t in firsts))
        spares = [r.info for r in mine if _took_part(r.info, incident)]
        if spares:
            incident.path = PATH_SPARE
            incident.spare_stage = spares[0].spare_stage
        return True

    def _give_up_oldest(self, uid: int | None) -> None:
        """End the oldest watch of this user's jobs: only their own incidents make room for theirs."""
        oldest = min((job for job in self._by_job if job[0] == uid), key=lambda job: self._by_job[job].seen_mono)
        self.stop_watching(self._by_job[oldest], "not_resumed")


def _fault_floor(incident: Incident) -> float:
    """The earliest a new process's first step counts as the job's return: the fault's onset, or, for a death the
    daemon saw after a warm spare had already stepped in its place, the dead rank's last step (the fault came after
    it)."""
    last = [t.rank.info.step_t for t in incident.targets if t.rank.pid in incident.gone_pids and t.rank.info.step_t]
    return min([incident.began, *last])


def _shows_return(info: TrainerInfo, incident: Incident) -> bool:
    """Whether `info`'s process shows its in-place job came back: it started since the fault, or it finished, after
    the fault, a step the lost rank cannot have taken part in (a step in flight at the fault, or a rollback's first
    step read before the spare's, is none: see the module docstring)."""
    if _own_first(info, incident) is not None:
        return True
    beyond = incident.last_step is None or (info.step is not None and info.step > incident.last_step + 1)
    return beyond and (info.step_t or 0.0) > incident.began


def _own_first(info: TrainerInfo, incident: Incident) -> tuple[int, float] | None:
    """The first step of a process that started since the fault (a spare in a lost rank's place), and when; None
    for a process that was stepping before it."""
    if info.first_step is not None and info.first_step_t is not None and info.first_step_t > incident.began:
        return info.first_step, info.first_step_t
    return None


def _first_after(info: TrainerInfo, incident: Incident) -> tuple[int, float]:
    """The first step `info`'s process is known to have finished after the fault, and when. A process that started
    since (a spare in a lost rank's place) says its first step exactly, however late its report is read: seen 2.4 s
    after a kill on an H100, the standby had redone its 8 steps and gone one past. A survivor's is the step seen."""
    return _own_first(info, incident) or (info.step or 0, info.step_t or 0.0)


def _took_part(info: TrainerInfo, incident: Incident) -> bool:
    """A spare that took the lost rank over and was in the job's first step after the fault: it started after
    the fault began and its first step is at most one past the furthest step before it (a sharded job rolls
    back and waits for it; a replicated job's survivors take that step without it, so it joins later)."""
    return (
        bool(info.spare)
        and info.first_step is not None
        and incident.last_step is not None
        and (info.first_step_t or 0.0) > incident.began
        and info.first_step <= incident.last_step + 1
    )
