"""Drills on one trainer rank: kill it, freeze it, or make it fault its own GPU context; the job must come back.

* kill_rank: SIGKILL the rank (a sudden death: OOM killer, segfault, lost GPU);
* hang_rank: SIGSTOP the rank (a hang: its peers wait in a collective); the daemon must find the
  hang (`trainer_hang`) and stop the job; the rank gets SIGCONT when the drill ends, however it ends;
* fault_rank: SIGUSR2 to a rank that opted in (`TrainerLink(allow_drills=True)`): it raises a real,
  harmless XID 31 in its own CUDA context, loses that context and must come back (XID 31 does not
  condemn the card).

Each ends with the job running again, read from the daemon's incident for the job (steps lost
included); when the process that would relaunch the job (`gpuwatch launch`, else torchrun's agent)
has exited, the wait fails at once instead of running out its deadline.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import psutil

from gpuwatch.drills import injectors
from gpuwatch.drills.daemon_client import gpus, incidents
from gpuwatch.drills.run_state import Run
from gpuwatch.drills.steps import Outcome, Pending, Step
from gpuwatch.errors import DrillError

if TYPE_CHECKING:  # pydantic loads with the first answer read, not with the daemon that imports the drills
    from gpuwatch.serving import wire

FAULT_SIGNAL = signal.SIGUSR2  # what TrainerLink(allow_drills=True) answers with a real XID 31
SUDDEN = ("rank_died", "gpu_fault")


def kill_rank(run: Run) -> list[Step]:
    victim = _victim(run)
    return [
        Step("kill", f"SIGKILL {victim.who} on GPU {run.gpu}", victim.send(signal.SIGKILL)),
        _exited(run, victim),
        _gone(run, victim),
        _resumed(run, victim, SUDDEN),
    ]


def hang_rank(run: Run) -> list[Step]:
    victim = _victim(run)
    trainer = run.config.trainer
    within = (
        trainer.hang_after_s + trainer.stale_after_s + 2 * run.config.interval_s + run.config.drills.detect_timeout_s
    )

    def found() -> Outcome:
        incident = _incident(run, victim, ("trainer_hang",))
        if incident is None:
            victim.check_supervisor()
            return Pending(f"no trainer_hang incident for job {victim.job} yet")
        return f"hang found and job stopped: {incident.reason}"

    def thaw() -> Outcome:
        if injectors.running(victim.pid):
            injectors.signal_rank(victim.pid, None, signal.SIGCONT)
            return f"sent SIGCONT to pid {victim.pid}"
        return f"pid {victim.pid} is gone (the daemon stopped it)"

    return [
        Step("freeze", f"SIGSTOP {victim.who} on GPU {run.gpu}", victim.send(signal.SIGSTOP)),
        Step("hang_found", f"wait for a trainer_hang incident on job {victim.job}", found, within),
        _resumed(run, victim, ("trainer_hang",)),
        Step("thaw", f"SIGCONT pid {victim.pid} if it still exists", thaw, always=True),
    ]


def fault_rank(run: Run) -> list[Step]:
    victim = _victim(run)
    return [
        Step("fault", f"SIGUSR2 {victim.who}: a real XID 31 in its own CUDA context", victim.send(FAULT_SIGNAL)),
        _exited(run, victim),
        _resumed(run, victim, SUDDEN),
    ]


class _Victim:
    """The rank a drill hits, and the process that would relaunch its job."""

    def __init__(self, run: Run, info: wire.Trainer) -> None:
        self.info = info
        self.pid = info.pid
        self.rank, self.job = info.rank, info.job_id
        self.reported = info.updated_t
        self.who = f"rank {self.rank} (pid {self.pid}, job {self.job})"
        self.supervisor = supervisor(self.pid)

    def send(self, sig: signal.Signals) -> Any:
        def act() -> Outcome:
            return injectors.signal_rank(self.pid, self.reported, sig)

        return act

    def check_supervisor(self) -> None:
        """Fail now when nothing is left to relaunch the job."""
        if self.supervisor is not None and not injectors.running(self.supervisor[0]):
            pid, what = self.supervisor
            raise DrillError(f"{what} (pid {pid}) exited: nothing will relaunch job {self.job}")


def _victim(run: Run) -> _Victim:
    assert run.victim is not None, "the kill_rank guard picked the victim"
    return _Victim(run, run.victim)


def supervisor(pid: int) -> tuple[int, str] | None:
    """The process that relaunches `pid`'s job: `gpuwatch launch` above it, else torchrun's agent."""
    try:
        parents = psutil.Process(pid).parents()
    except psutil.Error:
        return None
    found = None
    for parent in parents:
        try:
            cmdline = " ".join(parent.cmdline())
        except psutil.Error:
            continue
        if "gpuwatch" in cmdline and " launch" in cmdline:
            return parent.pid, "gpuwatch launch"
        if found is None and ("torch.distributed.run" in cmdline or "torchrun" in cmdline):
            found = (parent.pid, "torchrun")
    return found


def _exited(run: Run, victim: _Victim) -> Step:
    def check() -> Outcome:
        return Pending(f"pid {victim.pid} still runs") if injectors.running(victim.pid) else f"pid {victim.pid} exited"

    return Step("rank_exited", f"wait for pid {victim.pid} to exit", check, run.config.drills.detect_timeout_s)


def _gone(run: Run, victim: _Victim) -> Step:
    def check() -> Outcome:
        holders = [g.index for g in gpus(run.api) if victim.pid in {t.pid for t in g.trainers}]
        return Pending(f"GPU {holders} still lists pid {victim.pid}") if holders else f"no GPU lists pid {victim.pid}"

    within = run.config.interval_s + run.config.drills.detect_timeout_s
    return Step("rank_gone", "wait for the daemon to drop the rank from /v1/gpus", check, within)


def _incident(run: Run, victim: _Victim, kinds: tuple[str, ...]) -> wire.Incident | None:
    """The daemon's newest incident of the victim's job, of one of `kinds`, since the drill started."""
    for incident in incidents(run.api, limit=20):
        jobs = (incident.job or "").split(",")
        if incident.kind in kinds and victim.job in jobs and incident.t >= run.started - 1:
            return incident
    return None


def _resumed(run: Run, victim: _Victim, kinds: tuple[str, ...]) -> Step:
    def check() -> Outcome:
        incident = _incident(run, victim, kinds)
        if incident is not None and incident.status == "resumed":
            how = "went on in place" if incident.path == "in_place" else "resumed"
            return (
                f"job {victim.job} {how} at step {incident.resumed_step}, "
                f"{incident.time_to_resume_s} s after the fault began, {incident.steps_lost} step(s) lost"
            )
        if incident is not None and incident.status == "not_resumed":
            raise DrillError(f"the daemon gave up waiting for job {victim.job} to resume")
        if incident is not None and incident.status == "interrupted":
            raise DrillError(f"job {victim.job} was hit by another fault before it came back")
        victim.check_supervisor()
        seen = f"incident {incident.id} is {incident.status}" if incident else "no incident yet"
        return Pending(f"job {victim.job} has not come back ({seen})")

    plan = f"wait for job {victim.job} to run again (the daemon's incident: resumed, steps lost)"
    return Step("job_resumed", plan, check, run.config.drills.resume_timeout_s)
