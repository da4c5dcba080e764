"""Which faults are news, when each began, and whose work it hurt: what remediation may stop jobs for.

A fault acts once, and only on jobs it can have hurt:

* an XID event is news once (its own time and source are its identity), and only when it happened
  after the daemon started: the kernel log replayed at start is history, listed but never acted on,
  so a daemon restart never stops a job for an old fault;
* a GPU-wide fault (an XID the catalog blames on the card, a double-bit ECC finding, a lost GPU)
  hurts the ranks that were on that GPU when it began: a rank that started after it is not stopped;
* an application XID (13, 31, 43, 45 …: the catalog's restart_app) is that application's own error:
  when the kernel log names its pid, it hurts only the job that pid belongs to (a rank, or a child of
  one), and nobody when the pid is in no job; NVML's event names no pid, so an application XID waits
  up to PID_WAIT_S for the kernel log's line, and is only then judged without one (as before: every
  job on the GPU), which its incident says.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwatch.health.xid_catalog import lookup
from gpuwatch.model import Action, Finding, GpuEvent, Snapshot

PID_WAIT_S = 3.0  # how long an application XID without a pid waits for the kernel log's line
STARTED_SLACK_S = 0.5  # clock-tick and kernel-timestamp resolution: a rank this soon after a fault may have met it
GPU_WIDE_RULES = frozenset({"ecc_uncorrectable", "gpu_lost", "gpu_reset_required"})
_SEEN_MAX = 4096


@dataclass(frozen=True)
class Fault:
    """One fault to act on: where, when it began, what it is, and whose it is (pid) when the kernel said."""

    gpu: int
    t: float  # when it began (the event's own time; a finding's first publish)
    reason: str
    xid: int | None = None
    pid: int | None = None
    app: bool = False  # the application's own error: only the job of `pid` is hurt
    pid_unknown: bool = False  # an application fault judged without its pid (every job on the GPU)

    @property
    def gpu_wide(self) -> bool:
        return not self.app or self.pid_unknown


class FaultTracker:
    """Turns each publish into the faults that are news; owned by the remediation thread."""

    def __init__(self, started_t: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.started_t = started_t  # the daemon's start, on the clock of the events (Unix time)
        self._clock = clock  # for the waits (monotonic)
        self._seen: set[tuple[str, str, float, int]] = set()
        self._order: deque[tuple[str, str, float, int]] = deque()
        self._pending: dict[tuple[str, str, float, int], tuple[float, GpuEvent]] = {}  # key → (deadline, event)
        self._active: set[tuple[int, str]] = set()
        self._first_publish = True

    def news(self, snapshot: Snapshot) -> list[Fault]:
        """The faults this publish brings (and application XIDs whose wait for a pid is over)."""
        faults = []
        kernel_log = snapshot.kernel_log_readable is True
        now = self._clock()
        for gpu in snapshot.gpus:
            for event in gpu.xid_events:
                key = (gpu.uuid, event.source, round(event.t, 3), event.xid or 0)
                if key in self._seen:
                    continue
                if event.t < self.started_t - STARTED_SLACK_S:
                    self._remember(key)  # the kernel log's replay at start: history, not news
                    continue
                app = _is_app_xid(event.xid)
                if app and event.pid is None and kernel_log:
                    deadline, _ = self._pending.setdefault(key, (now + PID_WAIT_S, event))
                    if now < deadline:
                        continue  # the kernel log's line, with the pid, is usually a moment behind
                self._pending.pop(key, None)
                self._remember(key)
                faults.append(_xid_fault(gpu.index, event, app, kernel_log))
            faults += self._findings(snapshot, gpu.index, gpu.findings)
        faults += self.overdue(now)
        self._first_publish = False
        return faults

    def overdue(self, now: float | None = None) -> list[Fault]:
        """Application XIDs whose wait for the kernel log's pid ran out: judged without one."""
        now = self._clock() if now is None else now
        due = [(key, event) for key, (deadline, event) in self._pending.items() if now >= deadline]
        for key, _ in due:
            del self._pending[key]
            self._remember(key)
        return [_xid_fault(event.index, event, True, True) for _, event in due]

    def waiting(self) -> bool:
        return bool(self._pending)

    def _findings(self, snapshot: Snapshot, index: int, findings: Iterable[Finding]) -> list[Fault]:
        """GPU-wide findings that appeared in this publish (those present at the first publish are history)."""
        wide = [f for f in findings if f.rule in GPU_WIDE_RULES]
        faults = [
            Fault(index, snapshot.t, f.reason)
            for f in wide
            if (index, f.rule) not in self._active and not self._first_publish
        ]
        self._active = {k for k in self._active if k[0] != index} | {(index, f.rule) for f in wide}
        return faults

    def _remember(self, key: tuple[str, str, float, int]) -> None:
        self._seen.add(key)
        self._order.append(key)
        while len(self._order) > _SEEN_MAX:
            self._seen.discard(self._order.popleft())


def _is_app_xid(xid: int | None) -> bool:
    """An application's own error by the catalog (restart the app), not a fault of the card."""
    return xid is not None and lookup(xid).action is Action.RESTART_APP


def _xid_fault(index: int, event: GpuEvent, app: bool, kernel_log: bool) -> Fault:
    info = lookup(event.xid or 0)
    reason = f"XID {event.xid} ({info.description})"
    if event.pid is not None:
        reason += f" from pid {event.pid}"
    unknown = app and event.pid is None
    if unknown:
        why = "the kernel log named no pid" if kernel_log else "the kernel log is not readable"
        reason += f"; the faulting process is unknown ({why}): every job on GPU {index} is stopped"
    return Fault(index, event.t, reason, event.xid, event.pid, app=app, pid_unknown=unknown)
