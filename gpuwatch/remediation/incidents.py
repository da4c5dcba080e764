"""Incidents: one record per job stop (or idle quarantine), stored, counted, and the latest one exported.

An incident names what started it (`kind`): `quarantine` (the state machine, an operator or a
drill took the GPU), `gpu_fault` (an XID, ECC or lost-GPU event hit a GPU that had ranks, or an
application XID named a rank's pid), `rank_died` (a rank's process vanished without a clean end)
or `trainer_hang` (the job's steps stopped). `cause` is the quarantine's reason for a quarantine,
else the kind. `path` is how the job comes back: `relaunch` (its ranks stop and a launcher starts
them again), `in_place` (its survivors re-form without the ranks that left and go on) or `spare` (a
warm spare took the lost rank's place and the job's next step came with it: a one-GPU job, a sharded
one). The path is set when the incident opens, from the ranks' `recovery`, and becomes `spare` when
the job comes back through a process whose report says it took its rank over as a spare.

The clocks, all Unix times: `began_t` when the fault began (the kill, the XID's own time, the last
step of a hung job, the decision of a quarantine; a vanished rank's death: remediation.onset), `t`
when the daemon knew (detected), `stopped_t` when the last stopped rank was gone, `next_step_t` when
the job finished its next step. `time_to_resume_s` counts from `began_t`. Steps lost are the
furthest step any of the job's ranks finished before the stop (their step pages: exact, even after a
SIGKILL) minus the step it resumed from (the relaunch's `first_step - 1`; in place, the step before
the first one seen that shows the job came back: gpuwatch.remediation.resumes).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.errors import GpuwatchError
from gpuwatch.node.ranks import JobKey, Rank
from gpuwatch.node.store import Store

log = logging.getLogger("gpuwatch.remediation")

KINDS = ("quarantine", "gpu_fault", "rank_died", "trainer_hang")
PATH_RELAUNCH, PATH_IN_PLACE, PATH_SPARE = "relaunch", "in_place", "spare"


@dataclass
class Target:
    """A rank being stopped, and how it ended: exited, SIGTERM, SIGKILL, died (before the stop), or running."""

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
            "uid": self.rank.uid,
            "on_quarantined_gpu": self.on_gpu,
            "ended": self.ended,
        }


@dataclass
class Incident:
    """One stop being handled. `t` is the decision's time on the daemon's clock."""

    kind: str
    gpu: int | None
    uuid: str
    cause: str
    reason: str
    t: float  # when the daemon knew (the decision, the death seen, the hang found)
    seen_mono: float  # time.monotonic() when remediation saw the decision
    seen_lag_s: float  # clock() − t at that moment
    jobs: frozenset[JobKey]
    targets: list[Target]
    began_t: float | None = None  # when the fault began; None: at `t`
    path: str = PATH_RELAUNCH
    auto: bool = True
    drill: bool = False
    stop_signal: str = "SIGUSR1"
    status: str = "stopping"
    last_step: int | None = None
    resumed_step: int | None = None
    time_to_stop_s: float | None = None
    time_to_resume_s: float | None = None
    steps_lost: int | None = None
    spare_stage: str | None = None  # path spare: how far the spare was at its hand-over (standby, warm)
    stopped_t: float | None = None
    next_step_t: float | None = None
    id: int = 0
    gone_pids: set[int] = field(default_factory=set)

    @property
    def began(self) -> float:
        return self.t if self.began_t is None else min(self.began_t, self.t)

    @property
    def uid(self) -> int | None:
        """The user whose job this is (None: a GPU's idle quarantine, or ranks of several users)."""
        users = {uid for uid, _ in self.jobs}
        return users.pop() if len(users) == 1 else None

    def since_decision(self) -> float:
        return round(self.seen_lag_s + time.monotonic() - self.seen_mono, 3)

    def resumed(self, resumed_step: int, next_step_t: float) -> None:
        """The job finished a step again at `next_step_t`, having resumed from `resumed_step`."""
        self.resumed_step = max(0, resumed_step)
        self.next_step_t = next_step_t
        self.time_to_resume_s = round(max(0.0, next_step_t - self.began), 3)
        if self.last_step is not None:
            self.steps_lost = max(0, self.last_step - self.resumed_step)

    def see_step(self, step: int | None) -> None:
        """Keep the furthest step any of the job's ranks reported before the stop."""
        if step is not None and (self.last_step is None or step > self.last_step):
            self.last_step = step

    def body(self) -> dict[str, Any]:
        """What the store keeps and GET /v1/incidents shows."""
        return {
            "kind": self.kind,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "cause": self.cause,
            "reason": self.reason,
            "auto": self.auto,
            "drill": self.drill,
            "job": ",".join(sorted(job for _, job in self.jobs)) or None,
            "uid": self.uid,
            "path": self.path,
            "stop_signal": self.stop_signal,
            "status": self.status,
            "ranks": [t.as_dict() for t in self.targets],
            "began_t": round(self.began, 3),
            "detected_t": round(self.t, 3),
            "stopped_t": self.stopped_t,
            "next_step_t": self.next_step_t,
            "time_to_stop_s": self.time_to_stop_s,
            "time_to_resume_s": self.time_to_resume_s,
            "steps_lost": self.steps_lost,
            "spare_stage": self.spare_stage,
            "last_step": self.last_step,
            "resumed_step": self.resumed_step,
        }


USER_INCIDENTS_PER_MIN = 20.0  # incidents a user's own ranks may open a minute (beyond: stopped, not recorded)


class IncidentBook:
    """Stores incidents and keeps the count and the latest one with trainers, for the metrics.

    A user's ranks can make incidents at will (processes that die, hang, fault their own context),
    so each user may open USER_INCIDENTS_PER_MIN a minute: a flood of one user's incidents cannot
    push other users' out of the store or the API. Quarantines (the daemon's and operators') are
    never limited.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._budget: dict[int | None, tuple[float, float]] = {}  # uid → (tokens, when counted)
        self.refused = 0
        self._lock = threading.Lock()
        self.version = 0
        latest = _stored(store)
        self.total = int(latest[0]["id"]) if latest else 0
        self.last: dict[str, Any] | None = next((i for i in latest if i.get("ranks")), None)

    def save(self, incident: Incident) -> None:
        """Store the incident (new or updated); a failing store is logged and never stops the escalation."""
        body = incident.body()
        new = incident.id == 0
        try:
            if new:
                incident.id = self.store.add_incident(incident.t, body)
            else:
                self.store.update_incident(incident.id, body)
        except GpuwatchError as exc:
            log.error("cannot store the incident on GPU %s: %s", incident.gpu, exc)
        with self._lock:
            if new:
                self.total += 1
            if incident.targets:  # an idle GPU's quarantine has no stop or resume to report
                self.last = {"id": incident.id, "t": incident.t, **body}
            self.version += 1

    def allow(self, incident: Incident) -> bool:
        """Whether this incident may be recorded: within its user's budget, or a quarantine."""
        if incident.kind == "quarantine" or not incident.jobs:
            return True
        now = time.monotonic()
        tokens, then = self._budget.get(incident.uid, (USER_INCIDENTS_PER_MIN, now))
        tokens = min(USER_INCIDENTS_PER_MIN, tokens + (now - then) * USER_INCIDENTS_PER_MIN / 60.0)
        if len(self._budget) > 4096:
            self._budget.clear()
        if tokens < 1.0:
            self._budget[incident.uid] = (tokens, now)
            self.refused += 1
            return False
        self._budget[incident.uid] = (tokens - 1.0, now)
        return True

    def latest(self) -> tuple[int, dict[str, Any] | None]:
        with self._lock:
            return self.total, self.last


def _stored(store: Store) -> list[dict[str, Any]]:
    try:
        return store.incidents(limit=100)
    except GpuwatchError as exc:
        log.error("cannot read earlier incidents: %s", exc)
        return []
