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
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpuwatch.base.command_error import fail
from gpuwatch.config import load
from gpuwatch.errors import GpuwatchError
from gpuwatch.launcher.daemon_dir import runtime_dir_for_ranks
from gpuwatch.launcher.daemon_gpus import in_place_views, usable
from gpuwatch.launcher.gpu_watch import QuarantineWatch, StopSwitch
from gpuwatch.launcher.job_args import LOCAL_RENDEZVOUS, LaunchCommand, torchrun_job_args
from gpuwatch.launcher.job_check import missing_job
from gpuwatch.launcher.join_watch import DEFAULT_JOIN_WITHIN_S
from gpuwatch.launcher.limits import raise_descriptor_limit
from gpuwatch.launcher.torchrun_output import TEE_ARGS, Failure, TorchrunOutput, failure_lines, say
from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV, secured_job_args, write_secret
from gpuwatch.trainer.contract import (
    EXIT_RESUME,
    LAUNCH_DIR_ENV,
    REPORTS_REQUIRED_ENV,
    RUNTIME_DIR_ENV,
    STEP_PAGE_BYTES,
    StepPage,
    read_step_page,
    step_page_pid,
)

if TYPE_CHECKING:  # the answers' models; pydantic is loaded only once the daemon is asked (gpuwatch.serving.client)
    from gpuwatch.serving.wire import Gpu

COMMAND = "gpuwatch launch"  # the start of its error lines
EXIT_STOPPED = 3
TORCHRUN = (sys.executable, "-m", "gpuwatch.launcher.local_rendezvous")  # torchrun, with our one-node rendezvous
_SINGLE_NODE = {None, "1", "1:1"}
SPARES_NEED_IN_PLACE = (
    "--spares needs --in-place: torchrun starts each worker itself as a new interpreter and stops every worker"
    " when one fails, so there is no rank to hand to a warm spare"
)

Gpus = Callable[[], list["Gpu"]]
Runner = Callable[..., "Outcome"]  # (argv, env, stop, log_path): run_torchrun


class LaunchStopped(Exception):
    """The launcher's end other than success: one line, and the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Plan:
    """Everything a launch needs besides the GPUs: counts, limits, identity, torchrun's arguments."""

    nproc: int | None  # None: every usable GPU
    min_nproc: int
    max_restarts: int
    runtime_dir: str
    job_id: str
    rendezvous: tuple[str, ...]
    command: tuple[str, ...]
    stop_grace_s: float = 60.0  # the daemon's trainer.grace_period_s (GET /v1/daemon)
    watch_poll_s: float = 1.0  # how often QuarantineWatch asks the daemon


def rendezvous_args(
    *,
    nnodes: str | None,
    rdzv_backend: str | None,
    rdzv_endpoint: str | None,
    rdzv_conf: str | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    standalone: bool,
    job_id: str,
) -> tuple[str, ...]:
    """torchrun's rendezvous arguments, with the run id pinned to the job id.

    Single node (no rendezvous option, or --standalone) is our own rendezvous
    (gpuwatch.launcher.local_rendezvous): no state anyone can plant, the workers' store on loopback.

    Raises:
        click.UsageError: --standalone mixed with rendezvous options.
    """
    given = {
        "--rdzv-backend": rdzv_backend,
        "--rdzv-endpoint": rdzv_endpoint,
        "--node-rank": node_rank,
        "--master-addr": master_addr,
        "--master-port": master_port,
    }
    custom = any(v is not None for v in given.values()) or nnodes not in _SINGLE_NODE
    if standalone and custom:
        raise click.UsageError("--standalone cannot be combined with --nnodes or rendezvous options")
    conf = ("--rdzv-conf", rdzv_conf) if rdzv_conf else ()
    if not custom:
        local = ("--rdzv-backend", LOCAL_RENDEZVOUS, "--rdzv-endpoint", "127.0.0.1:0")
        return ("--nnodes", "1", *local, "--rdzv-id", job_id, *conf)
    args = [arg for flag, value in given.items() if value is not None for arg in (flag, str(value))]
    return (*(("--nnodes", nnodes) if nnodes else ()), *args, "--rdzv-id", job_id, *conf)


def root_cause(error_file: Path) -> tuple[int | None, str]:
    """The root-cause worker's exit code and first message line from torchrun's error file (None, "" if absent).

    torchrun writes it only when the root-cause worker left its own error file (TrainerLink's
    exit_for_resume does; a worker killed by a signal cannot): the summary on its stderr is the
    source that is always there (`failures`).
    """
    try:
        body = json.loads(error_file.read_text())
    except (OSError, ValueError):
        return None, ""
    message = body.get("message") if isinstance(body, dict) else None
    if isinstance(message, dict):
        code, text = message.get("errorCode", body.get("errorCode")), message.get("message", "")
    else:
        code, text = body.get("errorCode") if isinstance(body, dict) else None, message or ""
    lines = str(text).strip().splitlines()
    return (code if isinstance(code, int) else None), (lines[0] if lines else "")


@dataclass(frozen=True)
class Outcome:
    """How one torchrun run ended: its exit code, the signal we forwarded to it, its failed workers."""

    rc: int
    forwarded: int | None = None
    failures: tuple[Failure, ...] = ()  # torchrun's root cause first
    stopped: str | None = None  # why launch stopped it itself (QuarantineWatch)
    errors: dict[int, str] = field(default_factory=dict)  # local rank → its own last error line
    log: str | None = None  # torchrun's full output


def cause_of(failures: Sequence[Failure]) -> Failure | None:
    """The failure that ended the launch: torchrun's root cause, unless that is a rank that exited 75
    in the same second as a real failure (torchrun orders failures by whole seconds) or a teardown."""
    if not failures:
        return None
    root = failures[0]
    if root.exitcode in (EXIT_RESUME, -signal.SIGTERM):
        real = [f for f in failures if f.exitcode not in (EXIT_RESUME, -signal.SIGTERM)]
        if real:
            return real[0]
    return root


def run_torchrun(
    argv: list[str], env: dict[str, str], stop: StopSwitch | None = None, log_path: str | None = None
) -> Outcome:
    """Run torchrun in its own session; SIGINT/SIGTERM to us go to it once; `stop` ends it early. How it ended.

    Its own session, so a terminal's Ctrl-C reaches torchrun once (through us), not twice. Its stderr
    goes through TorchrunOutput: all of it to `log_path`, the workers' lines on to ours, and one line
    per failed rank at the end (torchrun's summary is also how we learn which worker failed and how:
    its error file is not written for a worker killed by a signal).

    Raises:
        LaunchStopped: torchrun could not be started.
    """
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE)
    except OSError as exc:
        raise LaunchStopped(2, f"cannot start torchrun ({argv[0]}): {exc.strerror or exc}") from None
    assert isinstance(proc.stderr, io.BufferedReader)
    with open(log_path or os.devnull, "ab") as log:
        output = TorchrunOutput(log)
        copier = threading.Thread(target=_copy, args=(proc.stderr, output), name="torchrun-stderr", daemon=True)
        copier.start()
        received: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            received.append(signum)
            proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = _wait(proc, stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        copier.join(timeout=5)
    failures = output.failures()
    stopped = stop.reason if stop is not None and stop.stopped else None
    if stopped is None and rc != 0:
        for line in failure_lines(failures, output.last_error, log_path or "(none)", COMMAND):
            say(line)
        if not failures and not received:
            error = output.own_error()
            say(f"{COMMAND}: torchrun exited {rc}{f': {error}' if error else ''}; its full output: {log_path}")
    return Outcome(rc, received[0] if received else None, failures, stopped, dict(output.last_error), log_path)


def _wait(proc: subprocess.Popen[bytes], stop: StopSwitch | None) -> int:
    """torchrun's exit code; when `stop` is set first, SIGTERM to torchrun (it tears its workers down), and
    SIGKILL if it has not ended _STOP_KILL_S later."""
    while stop is not None and not stop.stopped:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
    if stop is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=_STOP_KILL_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


_STOP_KILL_S = 60.0  # torchrun gives its workers 30 s after its SIGTERM


def _copy(stream: io.BufferedReader, output: TorchrunOutput) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        output.feed(chunk)
    output.finish()


class ProgressWatch:
    """The job's progress in one launch, from its ranks' step pages in the launch's own directory.

    Each launch gets a fresh directory, private to our user (GPUWATCH_LAUNCH_DIR): every rank of
    it rewrites its `<pid>.step` at each step, and the page stays after the rank is gone, so the
    furthest step is exact even for a rank killed by SIGKILL. A light thread reads the pages every
    POLL_S while the launch runs (to say when it resumed) and once more at the end.
    """

    POLL_S = 0.5

    def __init__(self, launch_dir: Path, on_first_step: Callable[[int], None] | None = None) -> None:
        self.launch_dir = launch_dir
        self.on_first_step = on_first_step
        self.furthest: int | None = None
        self.first_step: int | None = None
        self.reported = False  # a rank opened a step page (a TrainerLink): without one, no step is known
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-launch-progress", daemon=True)

    def __enter__(self) -> ProgressWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self.read()

    def _run(self) -> None:
        while not self._done.wait(self.POLL_S):
            self.read()

    def read(self) -> None:
        """Fold the pages there now into `furthest` and `first_step`."""
        try:
            names = [entry.name for entry in os.scandir(self.launch_dir)]
        except OSError:
            return
        for name in names:
            page = _read_own_page(self.launch_dir / name) if step_page_pid(name) is not None else None
            self.reported = self.reported or page is not None
            if page is None or page.step is None:
                continue
            if self.furthest is None or page.step > self.furthest:
                self.furthest = page.step
            first = page.first_step
            if first is not None and (self.first_step is None or first < self.first_step):
                if self.first_step is None and self.on_first_step is not None:
                    self.on_first_step(first)
                self.first_step = first


def _read_own_page(path: Path) -> StepPage | None:
    """A step page our own user wrote (a regular file, not a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return read_step_page(os.pread(fd, STEP_PAGE_BYTES, 0))
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass
class _Crash:
    """The previous crashed launch, for the crash-loop rule."""

    furthest: int | None


class Launcher:
    """The launch loop: pick GPUs, run torchrun, relaunch after a stop for resume or a crash."""

    def __init__(self, plan: Plan, gpus: Gpus, runner: Runner = run_torchrun, echo: Callable[[str], None] = print):
        self.plan = plan
        self.gpus = gpus
        self.runner = runner
        self.echo = echo
        self._log: str | None = None  # torchrun's full output, made by run()

    def run(self) -> int:
        """Launch until the job finishes; 0 on success.

        Raises:
            LaunchStopped: too few GPUs, restarts used up, a crash loop, torchrun failed to start or
                was interrupted.
            GpuwatchError: the daemon could not be asked before the first launch.
        """
        self._log = log_path = _torchrun_log(self.plan.job_id)
        with tempfile.TemporaryDirectory(prefix="gpuwatch-launch-") as tmp:
            launch, reason, gpus = 0, "first launch", usable(self.gpus())
            last_crash: _Crash | None = None
            while True:
                chosen = self._choose(gpus)
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
                with ProgressWatch(launch_dir, resumed_line) as progress, watch:
                    outcome = self.runner(self._argv(n, Path(tmp) / f"torchrun-{launch}"), env, switch, log_path)
                if outcome.rc == 0 and outcome.stopped is None:
                    self.echo(f"gpuwatch launch: job {self.plan.job_id} finished after {launch} relaunch(es)")
                    return 0
                if outcome.forwarded is not None:
                    raise LaunchStopped(
                        outcome.rc, f"stopped by {signal.Signals(outcome.forwarded).name}; torchrun exited {outcome.rc}"
                    )
                code, message = root_cause(error_file)
                failure = cause_of(outcome.failures)
                resumed = failure.exitcode == EXIT_RESUME if failure is not None else code == EXIT_RESUME
                everything = self._ask_daemon()
                if outcome.stopped is not None:
                    what = "launch stopped the job off a quarantined GPU"
                    cause = outcome.stopped
                elif resumed:
                    what = "the job stopped for resume"
                    cause = None
                else:
                    at = _when(progress.furthest, progress.reported)
                    cause = self._crash_cause(failure, outcome.rc, chosen, everything, at)
                    what = f"the job crashed ({cause})"
                    self._stop_a_crash_loop(last_crash, progress.furthest, chosen, everything, at)
                    last_crash = _Crash(progress.furthest)
                if launch >= self.plan.max_restarts:
                    raise LaunchStopped(EXIT_STOPPED, f"{what}, but --max-restarts {self.plan.max_restarts} is used up")
                if everything is None:
                    gpus = chosen
                    reason = cause or "the job stopped for resume"
                elif outcome.stopped is not None:
                    gpus, reason = usable(everything), outcome.stopped
                else:
                    gpus = usable(everything)
                    reason = _why_relaunch(chosen, everything, gpus, message, cause)
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
            return f"torchrun exited {rc}{at}, no worker named: see its full output in {self._log}"
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
        self,
        last_crash: _Crash | None,
        furthest: int | None,
        chosen: list[Gpu],
        everything: list[Gpu] | None,
        at: str,
    ) -> None:
        """Stop (exit 3) when this crash repeats the last one's step with no hardware finding: a software fault.

        Without the daemon's answer a finding cannot be ruled out: no stop (--max-restarts still bounds it).
        """
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

    def _choose(self, gpus: list[Gpu]) -> list[Gpu]:
        want = len(gpus) if self.plan.nproc is None else min(self.plan.nproc, len(gpus))
        if want < self.plan.min_nproc:
            raise LaunchStopped(
                EXIT_STOPPED,
                f"{len(gpus)} usable GPU(s) on this node, fewer than --min-nproc {self.plan.min_nproc}",
            )
        return gpus[:want]

    def _argv(self, nproc: int, log_dir: Path) -> list[str]:
        """torchrun's command line; its workers' stderr is teed (prefixed) for TorchrunOutput."""
        return [
            *TORCHRUN,
            "--max-restarts",
            "0",
            "--nproc-per-node",
            str(nproc),
            "--log-dir",
            str(log_dir),
            *TEE_ARGS,
            *self.plan.rendezvous,
            *(
                secured_job_args(self.plan.command, sys.executable)
                if self._local
                else torchrun_job_args(self.plan.command)
            ),
        ]

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
        if self._local:  # the agent's store and the workers prove this launch's secret (gpuwatch.launcher.worker_plane)
            env[WORKER_SECRET_ENV] = str(write_secret(error_file.parent / f"{launch_dir.name}.secret"))
        return env

    @property
    def _local(self) -> bool:
        return LOCAL_RENDEZVOUS in self.plan.rendezvous


def _when(furthest: int | None, reported: bool) -> str:
    """ "after step 37", "before its first step", or what is known when no rank reports its steps (no TrainerLink)."""
    if furthest is not None:
        return f"after step {furthest}"
    return "before its first step" if reported else "(no rank reports its steps)"


def _torchrun_log(job_id: str) -> str:
    """A new file, ours alone, for torchrun's full output across the launch's relaunches; kept after it ends."""
    safe = re.sub(r"[^\w.-]", "_", job_id)[:64]
    fd, path = tempfile.mkstemp(prefix=f"gpuwatch-launch-{safe}-", suffix=".log")
    os.close(fd)
    return path


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


def _check_in_place_flags(rendezvous: dict[str, Any], secret_file: str | None) -> None:
    """--in-place runs its own store: torchrun's rendezvous flags are one line and exit 2."""
    torchrun_only = ("rdzv_conf", "node_rank", "master_addr", "master_port")
    given = [f"--{k.replace('_', '-')}" for k in torchrun_only if rendezvous[k] is not None]
    given += ["--rdzv-backend"] if rendezvous["rdzv_backend"] not in (None, "c10d") else []
    if given:
        fail(f"--in-place runs its own store: {', '.join(given)} apply to torchrun only", command=COMMAND)
    if rendezvous["nnodes"] not in _SINGLE_NODE and not rendezvous["rdzv_endpoint"]:
        fail("a multi-node --in-place job needs --rdzv-endpoint HOST:PORT (its store)", command=COMMAND)
    if rendezvous["rdzv_endpoint"] and not secret_file:
        fail("--in-place with --rdzv-endpoint needs --inplace-secret-file (the job's secret)", command=COMMAND)


class _Nproc(click.ParamType):
    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value in (None, "auto"):
            return None
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            self.fail(f"{value!r} is neither a positive number nor 'auto'", param, ctx)
        return n


@click.command(
    cls=LaunchCommand, context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
)
@click.option("--nproc-per-node", "nproc", type=_Nproc(), default="auto", show_default=True, help="Ranks per launch.")
@click.option("--min-nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Stop below this.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True, help="Relaunches at most.")
@click.option(
    "--runtime-dir", help="Only checked: the ranks get the daemon's own runtime dir (a different one: exit 2)."
)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--listen", help="HOST:PORT of the daemon's API (default 127.0.0.1:9835).")
@click.option("--state-dir", help="The daemon's state dir.")
@click.option("--nnodes", help="torchrun --nnodes (MIN:MAX).")
@click.option("--rdzv-backend", help="torchrun --rdzv-backend.")
@click.option("--rdzv-endpoint", help="torchrun --rdzv-endpoint.")
@click.option("--rdzv-id", help="torchrun --rdzv-id; also the job id (default $GPUWATCH_JOB_ID or a new one).")
@click.option("--rdzv-conf", help="torchrun --rdzv-conf.")
@click.option("--node-rank", type=click.IntRange(min=0), help="torchrun --node-rank.")
@click.option("--master-addr", help="torchrun --master-addr.")
@click.option("--master-port", type=click.IntRange(1, 65535), help="torchrun --master-port.")
@click.option("--standalone", is_flag=True, help="Single node (the default when no rendezvous option is given).")
@click.option(
    "--in-place", is_flag=True, help="Recover in place: run the workers here, survivors go on (gpuwatch.inplace)."
)
@click.option(
    "--inplace-secret-file",
    help="--in-place with --rdzv-endpoint: your file (mode 600) holding the job's secret, the same on every node.",
)
@click.option(
    "--join-within",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_JOIN_WITHIN_S,
    show_default=True,
    help="--in-place: refuse the job (exit 2) when none of its workers joined it (InPlaceJob) by then, in seconds.",
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    help="Warm standby workers (--in-place only; default trainer.spares).",
)
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
    if command[0].startswith("-") and command[0] not in {"-m", "--module"}:
        fail(f"expected [-m] SCRIPT after the options, not {command[0]!r} (put the job after --)", command=COMMAND)
    if command[0] in {"-m", "--module"} and len(command) < 2:
        fail("-m needs a module name", command=COMMAND)
    if importlib.util.find_spec("torch") is None:  # torchrun, and so the job, runs with this very Python
        fail(
            f"torch is not installed in {sys.executable}, the Python that runs torchrun and the job: install "
            "gpuwatch-daemon into the job's own environment and run that environment's gpuwatch launch "
            f"(or {sys.executable} -m pip install torch)",
            command=COMMAND,
        )
    if rendezvous["nnodes"] not in _SINGLE_NODE and not (rdzv_id or os.environ.get("GPUWATCH_JOB_ID")):
        fail("a multi-node job needs --rdzv-id, the same on every node (it is also the job id)", command=COMMAND)
    job_id = rdzv_id or os.environ.get("GPUWATCH_JOB_ID") or f"gpuwatch-{uuid.uuid4().hex[:12]}"
    raise_descriptor_limit()  # the ranks inherit it: idle connections from others cannot exhaust a rank's
    if inplace_secret_file and not in_place:
        fail("--inplace-secret-file applies to --in-place only", command=COMMAND)
    try:
        from gpuwatch.serving.client import DaemonClient

        config = load(config_path, overrides={"listen": listen, "state_dir": state_dir, "runtime_dir": runtime_dir})
        torchrun_rendezvous = rendezvous_args(job_id=job_id, **rendezvous)
        if in_place:
            _check_in_place_flags(rendezvous, inplace_secret_file)
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
