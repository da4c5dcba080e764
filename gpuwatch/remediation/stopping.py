"""Stopping a job's ranks: the stop signal, then SIGTERM, then SIGKILL, each after its wait.

A `JobStop` never sleeps: the remediation thread calls `advance()` whenever a rank exits or a
deadline passes, so one thread escalates any number of stops at once. Every signal goes through
gpuwatch.remediation.signals: a pidfd, after checking that the process is still the rank (start
time, user, program). A rank that is stopped (SIGSTOP, run state T) cannot checkpoint, and while it
lives its peers wait on it in a collective: it gets SIGKILL at once, so they get out (gloo sees the
peer gone; NCCL ranks abort on the stop signal) and save, or re-form without it in place.
"""

from __future__ import annotations

import logging
import signal
import time

from gpuwatch.base.procfs import ProcFs
from gpuwatch.config import TrainerConfig
from gpuwatch.remediation import signals
from gpuwatch.remediation.incidents import Incident, Target

log = logging.getLogger("gpuwatch.remediation")

_FROZEN = {"T", "t"}


class JobStop:
    """The escalation of one incident's targets, driven by `advance()`."""

    def __init__(self, incident: Incident, cfg: TrainerConfig, stop_signal: signal.Signals, proc: ProcFs) -> None:
        self.incident = incident
        self.proc = proc
        self._phases: list[tuple[float, signal.Signals | None]] = [
            (cfg.grace_period_s, signal.SIGTERM),
            (cfg.kill_after_s, signal.SIGKILL),
            (cfg.kill_after_s, None),
        ]
        self._how = "exited"
        self.deadline = time.monotonic() + self._phases[0][0]
        alive = self._alive()
        sent = [target for target in alive if self._signal(target, stop_signal)]
        if sent:
            log.warning("GPU %s: %s: sent %s to %s", incident.gpu, incident.cause, stop_signal.name, _pids(sent))
        self._kill_frozen(self._alive())
        self.done = not self._alive()

    def advance(self) -> bool:
        """Note who is gone, escalate what is due; True once every target is gone or beyond SIGKILL."""
        if self.done:
            return True
        alive = self._alive()
        self._kill_frozen(alive)
        alive = self._alive()
        while alive and time.monotonic() >= self.deadline:
            wait_s, escalate = self._phases.pop(0)
            if escalate is None:
                for target in alive:
                    target.ended = "running"
                log.error("GPU %s: %s survived SIGKILL", self.incident.gpu, _pids(alive))
                alive = []
                break
            sent = [target for target in alive if self._signal(target, escalate)]
            if sent:
                log.warning(
                    "GPU %s: %s still running after %g s: sent %s",
                    self.incident.gpu,
                    _pids(sent),
                    wait_s,
                    escalate.name,
                )
            self._how = escalate.name
            self.deadline += self._phases[0][0]
            alive = self._alive()
        self.done = not alive
        return self.done

    def _kill_frozen(self, alive: list[Target]) -> None:
        frozen = [t for t in alive if self.proc.run_state(t.rank.pid) in _FROZEN]
        killed = [t for t in frozen if self._signal(t, signal.SIGKILL)]
        if killed:
            log.warning("GPU %s: %s stopped (SIGSTOP): sent SIGKILL", self.incident.gpu, _pids(killed))
        for target in killed:
            target.ended = "SIGKILL"
            self.incident.gone_pids.add(target.rank.pid)

    def _alive(self) -> list[Target]:
        """The targets still running; the others get how they ended."""
        alive = []
        for target in self.incident.targets:
            if target.ended is not None:
                continue
            if self.proc.alive(target.rank.pid, target.rank.start_time):
                alive.append(target)
            else:
                target.ended = self._how
                self.incident.gone_pids.add(target.rank.pid)
        return alive

    def _signal(self, target: Target, sig: signal.Signals) -> bool:
        """Send `sig` to the target; True when it was sent (a log line names only those)."""
        outcome = signals.send(target.rank, sig, self.proc)
        if outcome == signals.REFUSED:
            target.ended = "not_a_rank"  # it exec'd another program or changed user: never signalled again
            self.incident.gone_pids.add(target.rank.pid)
        return outcome == signals.SENT


def _pids(targets: list[Target]) -> str:
    return ", ".join(
        f"pid {t.rank.pid}" + (f" (rank {t.rank.info.rank})" if t.rank.info.rank is not None else "") for t in targets
    )
