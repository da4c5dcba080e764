"""`gpuwatch launch`: run a job through torchrun on this node's usable GPUs, and resume it when gpuwatch takes one.

torchrun cannot drop one GPU of a node: its `--nproc-per-node` and the CUDA_VISIBLE_DEVICES it
inherits are fixed for its life. So this launcher owns that choice. It asks the daemon for the GPUs
that are neither quarantined nor unhealthy, runs `python -m torch.distributed.run --max-restarts 0`
on them (CUDA_VISIBLE_DEVICES = their UUIDs, never indices), and reads how the job ended:

* torchrun exit 0: done.
* the root-cause worker exited 75 (TrainerLink.exit_for_resume: checkpoint saved, stop requested
  or peers' state rescued): relaunch on the GPUs usable now, with GPUWATCH_RESUME=1, and log which
  GPUs left and why. torchrun itself exits 1 whatever its workers did; the workers' codes and
  signals come from the summary torchrun prints on its stderr (gpuwatch.launcher.torchrun_output
  keeps it, and all of torchrun's own output, in a log file) and from the error file it writes to
  TORCHELASTIC_ERROR_FILE (only when the root cause left one).
* anything else (a rank killed by a signal, a non-zero exit, torchrun tearing the group down): a
  crash. Relaunch the same way, logging which rank, which GPU, the exit code or signal, and the
  daemon's finding on that GPU. A crash that did not get past the furthest step of the previous
  crash, with no hardware finding on the launch's GPUs, is a software fault: stop (exit 3).

The ranks report to the daemon's own runtime dir (GET /v1/daemon; one given by hand that differs is
refused), and while torchrun runs launch watches the daemon's GPU list itself
(gpuwatch.launcher.gpu_watch): a job the daemon cannot stop is moved off a quarantined GPU anyway.

The job's progress (furthest step, first step of a relaunch) comes from its ranks' step pages in
a directory of the launch's own (GPUWATCH_LAUNCH_DIR), exact even for a rank killed by SIGKILL.
When the daemon cannot be reached before a relaunch, that is said in one line and the job
relaunches on the same GPUs: a daemon restart must not kill the job.

It stops with one line and exit code 3 when fewer than --min-nproc GPUs are usable, after
--max-restarts relaunches (stops for resume and crashes alike), or on a crash loop.
GPUWATCH_JOB_ID (and torchrun's run id, so TORCHELASTIC_RUN_ID) stays the
same across relaunches: it is how the daemon ties the new launch to the incident of the old one.
Rendezvous options pass through to torchrun for multi-node jobs (each node drops its own bad GPUs;
torchrun numbers the ranks across nodes of different sizes, though its docs only promise equal ones).

Its parts: torchrun's command line (launcher.torchrun_args), its process and how it ended
(launcher.torchrun_process), the job's progress (launcher.launch_progress), the relaunch policy
(launcher.relaunch_policy), the command's options and checks (launcher.launch_options). The loop
runs in the command's thread and takes no lock: the quarantine watch tells it to stop only through
a StopSwitch (an Event), and the progress watch's fields are read after its thread is joined.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpuwatch.base.command_error import fail
from gpuwatch.config import load
from gpuwatch.errors import GpuwatchError
from gpuwatch.launcher.daemon_dir import runtime_dir_for_ranks
from gpuwatch.launcher.daemon_gpus import in_place_views, usable
from gpuwatch.launcher.gpu_watch import QuarantineWatch, StopSwitch
from gpuwatch.launcher.job_args import LaunchCommand
from gpuwatch.launcher.job_check import missing_job
from gpuwatch.launcher.launch_options import (
    SPARES_NEED_IN_PLACE,
    check_in_place_flags,
    check_job,
    job_id_for,
    launch_options,
)
from gpuwatch.launcher.launch_plan import COMMAND, EXIT_STOPPED, LaunchStopped, Plan
from gpuwatch.launcher.launch_progress import ProgressWatch
from gpuwatch.launcher.limits import raise_descriptor_limit
from gpuwatch.launcher.relaunch_policy import RelaunchPolicy
from gpuwatch.launcher.torchrun_args import TORCHRUN, local, rendezvous_args, torchrun_argv
from gpuwatch.launcher.torchrun_output import Failure
from gpuwatch.launcher.torchrun_process import Outcome, cause_of, root_cause, run_torchrun
from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV, write_secret
from gpuwatch.trainer.contract import EXIT_RESUME, LAUNCH_DIR_ENV, REPORTS_REQUIRED_ENV, RUNTIME_DIR_ENV

if TYPE_CHECKING:  # the answers' models; pydantic is loaded only once the daemon is asked (gpuwatch.serving.client)
    from gpuwatch.serving.wire import Gpu

__all__ = [  # what the CLI and the tests take from here; each part keeps its own
    "COMMAND",
    "EXIT_RESUME",
    "EXIT_STOPPED",
    "TORCHRUN",
    "Failure",
    "Launcher",
    "LaunchStopped",
    "Outcome",
    "Plan",
    "cause_of",
    "launch",
    "rendezvous_args",
    "root_cause",
    "run_torchrun",
    "usable",
]

Gpus = Callable[[], list["Gpu"]]
Runner = Callable[..., Outcome]  # (argv, env, stop, log_path): run_torchrun


class Launcher:
    """The launch loop: pick GPUs, run torchrun, relaunch after a stop for resume or a crash."""

    def __init__(self, plan: Plan, gpus: Gpus, runner: Runner = run_torchrun, echo: Callable[[str], None] = print):
        self.plan = plan
        self.gpus = gpus
        self.runner = runner
        self.echo = echo

    def run(self) -> int:
        """Launch until the job finishes; 0 on success.

        Raises:
            LaunchStopped: too few GPUs, restarts used up, a crash loop, torchrun failed to start or
                was interrupted.
            GpuwatchError: the daemon could not be asked before the first launch.
        """
        log_path = _torchrun_log(self.plan.job_id)
        policy = RelaunchPolicy(self.plan, log_path)
        with tempfile.TemporaryDirectory(prefix="gpuwatch-launch-") as tmp:
            launch, reason, gpus = 0, "first launch", usable(self.gpus())
            while True:
                chosen = policy.choose(gpus)
                error_file = Path(tmp) / f"error-{launch}.json"
                n = len(chosen)
                self.echo(
                    f"gpuwatch launch: launch {launch + 1} ({reason}): job {self.plan.job_id}, {n} rank(s) on GPU "
                    + ",".join(str(g.index) for g in chosen)
                )
                launch_dir = Path(tmp) / f"launch-{launch}"
                launch_dir.mkdir(mode=0o700)
                env = self._env(chosen, error_file, launch_dir, resume=launch > 0)
                resumed_line = self._say_resumed(launch + 1) if launch > 0 else None
                switch = StopSwitch()
                watch = QuarantineWatch(
                    self.gpus, chosen, self.plan.job_id, switch,
                    grace_s=self.plan.stop_grace_s, poll_s=self.plan.watch_poll_s,
                )  # fmt: skip
                argv = torchrun_argv(n, Path(tmp) / f"torchrun-{launch}", self.plan.rendezvous, self.plan.command)
                with ProgressWatch(launch_dir, resumed_line) as progress, watch:
                    outcome = self.runner(argv, env, switch, log_path)
                if outcome.rc == 0 and outcome.stopped is None:
                    self.echo(f"gpuwatch launch: job {self.plan.job_id} finished after {launch} relaunch(es)")
                    return 0
                if outcome.forwarded is not None:
                    raise LaunchStopped(
                        outcome.rc, f"stopped by {signal.Signals(outcome.forwarded).name}; torchrun exited {outcome.rc}"
                    )
                gpus, reason = policy.after(launch, outcome, error_file, chosen, self._ask_daemon(), progress)
                launch += 1
                self.echo(f"gpuwatch launch: relaunch {launch}/{self.plan.max_restarts}: {reason}")

    def _say_resumed(self, launch: int) -> Callable[[int], None]:
        """The line for a relaunch's first step, as soon as a rank reports it (it resumed from first_step - 1)."""
        return lambda first: self.echo(f"gpuwatch launch: launch {launch} resumed from step {first - 1}")

    def _ask_daemon(self) -> list[Gpu] | None:
        """The daemon's GPUs now, or None (said in one line) when it cannot be reached: relaunch on the same GPUs."""
        try:
            return self.gpus()
        except GpuwatchError as exc:
            self.echo(f"gpuwatch launch: {exc}: relaunching on the same GPUs")
            return None

    def _env(self, chosen: list[Gpu], error_file: Path, launch_dir: Path, *, resume: bool) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CUDA_VISIBLE_DEVICES=",".join(g.uuid for g in chosen),
            GPUWATCH_RUNTIME_DIR=self.plan.runtime_dir,
            GPUWATCH_JOB_ID=self.plan.job_id,
            TORCHELASTIC_ERROR_FILE=str(error_file),
        )
        env[LAUNCH_DIR_ENV] = str(launch_dir)
        env[REPORTS_REQUIRED_ENV] = "1"  # the runtime dir is the daemon's: a rank that cannot report is an error
        if resume:
            env["GPUWATCH_RESUME"] = "1"
        if local(self.plan.rendezvous):  # the agent's store and the workers prove this launch's secret (worker_plane)
            env[WORKER_SECRET_ENV] = str(write_secret(error_file.parent / f"{launch_dir.name}.secret"))
        return env


def _torchrun_log(job_id: str) -> str:
    """A new file, ours alone, for torchrun's full output across the launch's relaunches; kept after it ends."""
    safe = re.sub(r"[^\w.-]", "_", job_id)[:64]
    fd, path = tempfile.mkstemp(prefix=f"gpuwatch-launch-{safe}-", suffix=".log")
    os.close(fd)
    return path


@click.command(
    cls=LaunchCommand, context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
)
@launch_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True, metavar="-- [-m] SCRIPT [ARGS]...")
def launch(
    nproc: int | None,
    min_nproc: int,
    max_restarts: int,
    runtime_dir: str | None,
    config_path: str | None,
    listen: str | None,
    state_dir: str | None,
    command: tuple[str, ...],
    rdzv_id: str | None,
    in_place: bool,
    inplace_secret_file: str | None,
    spares: int | None,
    join_within: float,
    **rendezvous: Any,
) -> None:
    """Run a torchrun job on this node's usable GPUs; relaunch it on the rest when gpuwatch takes one.

    Workers that stop for gpuwatch exit 75 (gpuwatch.trainer.TrainerLink); a crash relaunches too; the
    relaunch sets GPUWATCH_RESUME=1. Exit 3: too few GPUs, restarts used up, or a crash loop.
    """
    check_job(command)
    job_id = job_id_for(rdzv_id, rendezvous["nnodes"])
    raise_descriptor_limit()  # the ranks inherit it: idle connections from others cannot exhaust a rank's
    if inplace_secret_file and not in_place:
        fail("--inplace-secret-file applies to --in-place only", command=COMMAND)
    try:
        from gpuwatch.serving.client import DaemonClient

        config = load(config_path, overrides={"listen": listen, "state_dir": state_dir, "runtime_dir": runtime_dir})
        torchrun_rendezvous = rendezvous_args(job_id=job_id, **rendezvous)
        if in_place:
            check_in_place_flags(rendezvous, inplace_secret_file)
        if spares and not in_place:  # trainer.spares, the node's default, applies to in-place launches only
            fail(SPARES_NEED_IN_PLACE, command=COMMAND)
        spare_count = config.trainer.spares if spares is None else spares
        daemon = DaemonClient(config).daemon_info()
        missing = missing_job(command, Path.cwd())
        if missing is not None:
            fail(missing, command=COMMAND)
        given_as = "--runtime-dir" if runtime_dir is not None else RUNTIME_DIR_ENV
        ranks_dir = runtime_dir_for_ranks(daemon.runtime_dir, runtime_dir or os.environ.get(RUNTIME_DIR_ENV), given_as)
        plan = Plan(
            nproc=nproc,
            min_nproc=min_nproc,
            max_restarts=max_restarts,
            runtime_dir=ranks_dir,
            job_id=job_id,
            rendezvous=torchrun_rendezvous,
            command=command,
            stop_grace_s=daemon.stop_grace_s,
        )
        if in_place:  # no torchrun: our own workers, membership and store (gpuwatch.launcher.in_place)
            from gpuwatch.launcher.in_place import GpuView, InPlacePlan, InPlaceStopped, Supervisor
            from gpuwatch.spares import SparePool

            client = DaemonClient(config)

            def gpu_views() -> list[GpuView]:
                return in_place_views(client.gpus())

            in_place_plan = InPlacePlan(
                job_id, command, ranks_dir, nproc, min_nproc, max_restarts,
                rendezvous["rdzv_endpoint"], rendezvous["nnodes"], secret_file=inplace_secret_file,
                join_within_s=join_within,
            )  # fmt: skip
            try:
                echo = lambda line: click.echo(line, err=True)  # noqa: E731
                cuda, standby = config.trainer.spare_cuda_context, config.trainer.spare_standby
                pool = SparePool(spare_count, os.environ, cuda=cuda, standby=standby, echo=echo)
                code = Supervisor(in_place_plan, gpu_views, echo=echo, spares=pool if spare_count else None).run()
            except InPlaceStopped as exc:
                raise LaunchStopped(exc.code, str(exc)) from None
            sys.exit(code)
        code = Launcher(plan, DaemonClient(config).gpus, echo=lambda line: click.echo(line, err=True)).run()
    except click.UsageError as exc:
        fail(exc.format_message(), command=COMMAND)
    except LaunchStopped as exc:
        fail(str(exc), exc.code, COMMAND)
    except GpuwatchError as exc:
        fail(str(exc), command=COMMAND)
    sys.exit(code)
