"""Incidents: one record per job stop (or idle quarantine), stored, counted, and the latest one exported.

An incident names what started it (`kind`): `quarantine` (the state machine, an operator or a
drill took the GPU), `gpu_fault` (an XID, ECC or lost-GPU event hit a GPU that had ranks),
`rank_died` (a rank's process vanished without a clean end) or `trainer_hang` (the job's steps
stopped). `cause` is the quarantine's reason for a quarantine, else the kind. The times are from
the decision (or the moment the fault was seen): to the last rank gone, and to the first step of
the relaunched job; steps lost are the last step seen before the stop minus the step the
relaunch resumed from (its first report's `first_step - 1`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.errors import GpuwatchError
from gpuwatch.ranks import Rank
from gpuwatch.store import Store

log = logging.getLogger("gpuwatch.remediation")

KINDS = ("quarantine", "gpu_fault", "rank_died", "trainer_hang")


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
    t: float
    seen_mono: float  # time.monotonic() when remediation saw the decision
    seen_lag_s: float  # clock() − t at that moment
    jobs: frozenset[str]
    targets: list[Target]
    auto: bool = True
    drill: bool = False
    stop_signal: str = "SIGUSR1"
    status: str = "stopping"
    last_step: int | None = None
    resumed_step: int | None = None
    time_to_stop_s: float | None = None
    time_to_resume_s: float | None = None
    steps_lost: int | None = None
    id: int = 0
    gone_pids: set[int] = field(default_factory=set)

    def since_decision(self) -> float:
        return round(self.seen_lag_s + time.monotonic() - self.seen_mono, 3)

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
            "job": ",".join(sorted(self.jobs)) or None,
            "stop_signal": self.stop_signal,
            "status": self.status,
            "ranks": [t.as_dict() for t in self.targets],
            "time_to_stop_s": self.time_to_stop_s,
            "time_to_resume_s": self.time_to_resume_s,
            "steps_lost": self.steps_lost,
            "last_step": self.last_step,
            "resumed_step": self.resumed_step,
        }


class IncidentBook:
    """Stores incidents and keeps the count and the latest one with trainers, for the metrics."""

    def __init__(self, store: Store) -> None:
        self.store = store
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

    def latest(self) -> tuple[int, dict[str, Any] | None]:
        with self._lock:
            return self.total, self.last


def _stored(store: Store) -> list[dict[str, Any]]:
    try:
        return store.incidents(limit=100)
    except GpuwatchError as exc:
        log.error("cannot read earlier incidents: %s", exc)
        return []
