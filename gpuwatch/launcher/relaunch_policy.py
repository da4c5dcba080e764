"""When a torchrun run of the job ends other than by success: relaunch it (on which GPUs, saying why) or stop.

A stop for resume (a rank exited 75) and a crash both relaunch, on the GPUs the daemon says are usable
now, until --max-restarts is used up. A crash that did not get past the furthest step of the previous
crash, with no hardware finding on the launch's GPUs, is a software fault: stop (exit 3). Without the
daemon's answer the job relaunches on the same GPUs, and a finding cannot be ruled out.

Locking: none. One policy per launch, used only by the launch loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwatch.launcher.daemon_gpus import usable
from gpuwatch.launcher.launch_plan import EXIT_STOPPED, LaunchStopped, Plan
from gpuwatch.launcher.launch_progress import ProgressWatch
from gpuwatch.launcher.torchrun_output import Failure
from gpuwatch.launcher.torchrun_process import Outcome, cause_of, root_cause
from gpuwatch.trainer.contract import EXIT_RESUME

if TYPE_CHECKING:  # the answers' models; pydantic is loaded only once the daemon is asked (gpuwatch.serving.client)
    from gpuwatch.serving.wire import Gpu


@dataclass
class _Crash:
    """The previous crashed launch, for the crash-loop rule."""

    furthest: int | None


class RelaunchPolicy:
    """How many GPUs a launch takes, and after each run that did not succeed, the next launch's GPUs and why."""

    def __init__(self, plan: Plan, log_path: str | None) -> None:
        self.plan = plan
        self.log_path = log_path  # torchrun's full output, named when no worker is
        self._last_crash: _Crash | None = None

    def choose(self, gpus: list[Gpu]) -> list[Gpu]:
        """The GPUs of the next launch: --nproc-per-node of the usable ones (all by default).

        Raises:
            LaunchStopped: fewer than --min-nproc usable.
        """
        want = len(gpus) if self.plan.nproc is None else min(self.plan.nproc, len(gpus))
        if want < self.plan.min_nproc:
            raise LaunchStopped(
                EXIT_STOPPED,
                f"{len(gpus)} usable GPU(s) on this node, fewer than --min-nproc {self.plan.min_nproc}",
            )
        return gpus[:want]

    def after(
        self,
        launch: int,
        outcome: Outcome,
        error_file: Path,
        chosen: list[Gpu],
        everything: list[Gpu] | None,
        progress: ProgressWatch,
    ) -> tuple[list[Gpu], str]:
        """The GPUs to relaunch on and why, after launch `launch` (0 first) on `chosen` ended with `outcome`.

        `everything` is the daemon's GPUs now (None: it could not be asked).

        Raises:
            LaunchStopped: --max-restarts used up, or a crash loop.
        """
        code, message = root_cause(error_file)
        failure = cause_of(outcome.failures)
        resumed = failure.exitcode == EXIT_RESUME if failure is not None else code == EXIT_RESUME
        if outcome.stopped is not None:
            what = "launch stopped the job off a quarantined GPU"
            cause = outcome.stopped
        elif resumed:
            what = "the job stopped for resume"
            cause = None
        else:
            at = progress.when()
            cause = self._crash_cause(failure, outcome.rc, chosen, everything, at)
            what = f"the job crashed ({cause})"
            self._stop_a_crash_loop(progress.furthest, chosen, everything, at)
            self._last_crash = _Crash(progress.furthest)
        if launch >= self.plan.max_restarts:
            raise LaunchStopped(EXIT_STOPPED, f"{what}, but --max-restarts {self.plan.max_restarts} is used up")
        if everything is None:
            return chosen, cause or "the job stopped for resume"
        if outcome.stopped is not None:
            return usable(everything), outcome.stopped
        gpus = usable(everything)
        return gpus, _why_relaunch(chosen, everything, gpus, message, cause)

    def _crash_cause(
        self,
        failure: Failure | None,
        rc: int,
        chosen: list[Gpu],
        everything: list[Gpu] | None,
        at: str,
    ) -> str:
        """ "rank 1 on GPU 1 (GPU-…) killed by SIGKILL after step 37, daemon: no finding on GPU 1"."""
        at = f" {at}"
        if failure is None:
            return f"torchrun exited {rc}{at}, no worker named: see its full output in {self.log_path}"
        gpu = chosen[failure.local_rank] if failure.local_rank < len(chosen) else None
        if gpu is None:
            return f"rank {failure.rank} {failure.how()}{at}"
        where = f"GPU {gpu.index} ({gpu.uuid})"
        if everything is None:
            daemon = "daemon not reachable"
        else:
            found = _hardware_findings([gpu], everything)
            daemon = f"daemon: {found[0]}" if found else f"daemon: no finding on GPU {gpu.index}"
        return f"rank {failure.rank} on {where} {failure.how()}{at}, {daemon}"

    def _stop_a_crash_loop(
        self, furthest: int | None, chosen: list[Gpu], everything: list[Gpu] | None, at: str
    ) -> None:
        """Stop (exit 3) when this crash repeats the last one's step with no hardware finding: a software fault.

        Without the daemon's answer a finding cannot be ruled out: no stop (--max-restarts still bounds it).
        """
        last_crash = self._last_crash
        if last_crash is None or everything is None or _hardware_findings(chosen, everything):
            return
        before = -1 if last_crash.furthest is None else last_crash.furthest
        if (-1 if furthest is None else furthest) > before:
            return
        at = at.replace("after step", "at step")
        indices = ",".join(str(g.index) for g in chosen)
        raise LaunchStopped(
            EXIT_STOPPED,
            f"job {self.plan.job_id} crashed twice {at} with no hardware finding on GPU {indices}: "
            "a software fault, not relaunching",
        )


def _hardware_findings(chosen: list[Gpu], everything: list[Gpu]) -> list[str]:
    """What the daemon holds against these GPUs: findings, quarantine, a state worse than healthy, or gone."""
    by_uuid = {g.uuid: g for g in everything}
    found = []
    for gpu in chosen:
        now = by_uuid.get(gpu.uuid)
        name = f"GPU {gpu.index}"
        if now is None:
            found.append(f"{name} gone")
            continue
        for finding in now.findings:
            found.append(f"{name} {finding.rule}: {finding.reason}")
        if now.quarantined:
            found.append(f"{name} quarantined: {now.quarantine_reason}")
        elif now.state != "healthy":
            found.append(f"{name} {now.state}")
    return found


def _why_relaunch(
    chosen: list[Gpu],
    everything: list[Gpu],
    now_usable: list[Gpu],
    message: str,
    crash: str | None = None,
) -> str:
    """The crash's cause and which of the launch's GPUs left and why (from the daemon)."""
    still = {g.uuid for g in now_usable}
    by_uuid = {g.uuid: g for g in everything}
    left = []
    for gpu in chosen:
        if gpu.uuid in still:
            continue
        now = by_uuid.get(gpu.uuid)
        why = "gone" if now is None else f"quarantined: {now.quarantine_reason}" if now.quarantined else now.state
        left.append(f"GPU {gpu.index} ({gpu.uuid}) left, {why}")
    if crash is not None:
        return "; ".join([crash, *left])
    if left:
        return "; ".join(left)
    return f"the job stopped for resume ({message or 'no reason given'}) with all its GPUs usable"
