"""`gpuwatch launch`: run a job through torchrun on this node's usable GPUs, and resume it when gpuwatch takes one.

torchrun cannot drop one GPU of a node: its `--nproc-per-node` and the CUDA_VISIBLE_DEVICES it
inherits are fixed for its life. So this launcher owns that choice. It asks the daemon for the GPUs
that are neither quarantined nor unhealthy, runs `python -m torch.distributed.run --max-restarts 0`
on them (CUDA_VISIBLE_DEVICES = their UUIDs, never indices), and reads how the job ended:

* torchrun exit 0: done.
* the root-cause worker exited 75 (TrainerLink.exit_for_resume: checkpoint saved, stop requested):
  torchrun itself exits 1 whatever its workers did, so the 75 is read from the error file torchrun
  writes to TORCHELASTIC_ERROR_FILE (`errorCode`). Relaunch on the GPUs usable now, with
  GPUWATCH_RESUME=1, and log which GPUs left and why.
* anything else: exit with torchrun's code and one line.

It stops with one line and exit code 3 when fewer than --min-nproc GPUs are usable or after
--max-restarts relaunches. GPUWATCH_JOB_ID (and torchrun's run id, so TORCHELASTIC_RUN_ID) stays the
same across relaunches: it is how the daemon ties the new launch to the incident of the old one.
Rendezvous options pass through to torchrun for multi-node jobs (each node drops its own bad GPUs;
torchrun numbers the ranks across nodes of different sizes, though its docs only promise equal ones).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from gpuwatch.config import load
from gpuwatch.errors import GpuwatchError

EXIT_RESUME = 75  # gpuwatch.trainer.EXIT_RESUME; not imported, so the launcher does not load the trainer side
EXIT_STOPPED = 3
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
_SINGLE_NODE = {None, "1", "1:1"}

Gpus = Callable[[], list[dict[str, Any]]]
Runner = Callable[[list[str], dict[str, str]], tuple[int, int | None]]


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


def usable(gpus: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs a job may use: not quarantined and not unhealthy by index."""
    return sorted((g for g in gpus if not g["quarantined"] and g["state"] != "unhealthy"), key=lambda g: g["index"])


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

    Single node (no rendezvous option, or --standalone) is torchrun's --standalone spelled out: a
    c10d store on a free local port, but with our run id where --standalone would draw a random one.

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
        return ("--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", job_id, *conf)
    args = [arg for flag, value in given.items() if value is not None for arg in (flag, str(value))]
    return (*(("--nnodes", nnodes) if nnodes else ()), *args, "--rdzv-id", job_id, *conf)


def root_cause(error_file: Path) -> tuple[int | None, str]:
    """The root-cause worker's exit code and first message line from torchrun's error file (None, "" if absent)."""
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


def run_torchrun(argv: list[str], env: dict[str, str]) -> tuple[int, int | None]:
    """Run torchrun in its own session; SIGINT/SIGTERM to us go to it once. Its exit code, and the signal forwarded.

    Its own session, so a terminal's Ctrl-C reaches torchrun once (through us), not twice.

    Raises:
        LaunchStopped: torchrun could not be started.
    """
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
    except OSError as exc:
        raise LaunchStopped(2, f"cannot start torchrun ({argv[0]}): {exc.strerror or exc}") from None
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc, (received[0] if received else None)


class Launcher:
    """The launch loop: pick GPUs, run torchrun, relaunch on a stop for resume."""

    def __init__(self, plan: Plan, gpus: Gpus, runner: Runner = run_torchrun, echo: Callable[[str], None] = print):
        self.plan = plan
        self.gpus = gpus
        self.runner = runner
        self.echo = echo

    def run(self) -> int:
        """Launch until the job finishes; 0 on success.

        Raises:
            LaunchStopped: too few GPUs, restarts used up, torchrun failed or was interrupted.
            GpuwatchError: the daemon could not be asked.
        """
        with tempfile.TemporaryDirectory(prefix="gpuwatch-launch-") as tmp:
            launch, reason, gpus = 0, "first launch", usable(self.gpus())
            while True:
                chosen = self._choose(gpus)
                error_file = Path(tmp) / f"error-{launch}.json"
                n = len(chosen)
                self.echo(
                    f"gpuwatch launch: launch {launch + 1} ({reason}): job {self.plan.job_id}, {n} rank(s) on GPU "
                    + ",".join(str(g["index"]) for g in chosen)
                )
                rc, forwarded = self.runner(self._argv(n), self._env(chosen, error_file, resume=launch > 0))
                if rc == 0:
                    self.echo(f"gpuwatch launch: job {self.plan.job_id} finished after {launch} relaunch(es)")
                    return 0
                code, message = root_cause(error_file)
                if forwarded is not None:
                    raise LaunchStopped(rc, f"stopped by {signal.Signals(forwarded).name}; torchrun exited {rc}")
                if code != EXIT_RESUME:
                    cause = (
                        f"root cause exit code {code}: {message}" if code is not None else "see torchrun's log above"
                    )
                    raise LaunchStopped(rc, f"torchrun exited {rc} ({cause})")
                if launch >= self.plan.max_restarts:
                    raise LaunchStopped(
                        EXIT_STOPPED,
                        f"the job stopped for resume, but --max-restarts {self.plan.max_restarts} is used up",
                    )
                everything = self.gpus()
                gpus = usable(everything)
                reason = _why_relaunch(chosen, everything, gpus, message)
                launch += 1
                self.echo(f"gpuwatch launch: relaunch {launch}/{self.plan.max_restarts}: {reason}")

    def _choose(self, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
        want = len(gpus) if self.plan.nproc is None else min(self.plan.nproc, len(gpus))
        if want < self.plan.min_nproc:
            raise LaunchStopped(
                EXIT_STOPPED,
                f"{len(gpus)} usable GPU(s) on this node, fewer than --min-nproc {self.plan.min_nproc}",
            )
        return gpus[:want]

    def _argv(self, nproc: int) -> list[str]:
        return [
            *TORCHRUN,
            "--max-restarts",
            "0",
            "--nproc-per-node",
            str(nproc),
            *self.plan.rendezvous,
            *self.plan.command,
        ]

    def _env(self, chosen: list[dict[str, Any]], error_file: Path, *, resume: bool) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CUDA_VISIBLE_DEVICES=",".join(g["uuid"] for g in chosen),
            GPUWATCH_RUNTIME_DIR=self.plan.runtime_dir,
            GPUWATCH_JOB_ID=self.plan.job_id,
            TORCHELASTIC_ERROR_FILE=str(error_file),
        )
        if resume:
            env["GPUWATCH_RESUME"] = "1"
        return env


def _why_relaunch(
    chosen: list[dict[str, Any]], everything: list[dict[str, Any]], now_usable: list[dict[str, Any]], message: str
) -> str:
    """Which of the launch's GPUs left and why (from the daemon), or the job's own reason when none did."""
    still = {g["uuid"] for g in now_usable}
    by_uuid = {g["uuid"]: g for g in everything}
    left = []
    for gpu in chosen:
        if gpu["uuid"] in still:
            continue
        now = by_uuid.get(gpu["uuid"], {})
        why = f"quarantined: {now.get('quarantine_reason')}" if now.get("quarantined") else now.get("state", "gone")
        left.append(f"GPU {gpu['index']} ({gpu['uuid']}) left, {why}")
    if left:
        return "; ".join(left)
    return f"the job stopped for resume ({message or 'no reason given'}) with all its GPUs usable"


class _OneLineUsage(click.Command):
    """A bad flag is one line and exit 2, like every other gpuwatch error."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            click.echo(f"gpuwatch launch: error: {exc.format_message()}", err=True)
            ctx.exit(2)


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
    cls=_OneLineUsage, context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
)
@click.option("--nproc-per-node", "nproc", type=_Nproc(), default="auto", show_default=True, help="Ranks per launch.")
@click.option("--min-nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Stop below this.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True, help="Relaunches at most.")
@click.option("--runtime-dir", help="The daemon's runtime dir, for the trainers (default: from the config).")
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
    **rendezvous: Any,
) -> None:
    """Run a torchrun job on this node's usable GPUs; relaunch it on the rest when gpuwatch takes one.

    Workers that stop for gpuwatch exit 75 (gpuwatch.trainer.TrainerLink); the relaunch sets
    GPUWATCH_RESUME=1. Exit 3: too few GPUs or restarts used up; otherwise torchrun's code.
    """
    if command[0].startswith("-") and command[0] not in {"-m", "--module"}:
        _fail(2, f"expected [-m] SCRIPT after the options, not {command[0]!r} (put the job after --)")
    if command[0] in {"-m", "--module"} and len(command) < 2:
        _fail(2, "-m needs a module name")
    if importlib.util.find_spec("torch") is None:
        _fail(2, "torch is not installed in this Python: torchrun is torch.distributed.run")
    if rendezvous["nnodes"] not in _SINGLE_NODE and not (rdzv_id or os.environ.get("GPUWATCH_JOB_ID")):
        _fail(2, "a multi-node job needs --rdzv-id, the same on every node (it is also the job id)")
    job_id = rdzv_id or os.environ.get("GPUWATCH_JOB_ID") or f"gpuwatch-{uuid.uuid4().hex[:12]}"
    try:
        from gpuwatch.client import DaemonClient

        config = load(config_path, overrides={"listen": listen, "state_dir": state_dir, "runtime_dir": runtime_dir})
        plan = Plan(
            nproc=nproc,
            min_nproc=min_nproc,
            max_restarts=max_restarts,
            runtime_dir=config.runtime_dir,
            job_id=job_id,
            rendezvous=rendezvous_args(job_id=job_id, **rendezvous),
            command=command,
        )
        code = Launcher(plan, DaemonClient(config).gpus, echo=lambda line: click.echo(line, err=True)).run()
    except click.UsageError as exc:
        _fail(2, exc.format_message())
    except LaunchStopped as exc:
        _fail(exc.code, str(exc))
    except GpuwatchError as exc:
        _fail(2, str(exc))
    sys.exit(code)


def _fail(code: int, message: str) -> NoReturn:
    """One line on stderr; a negative code (torchrun killed by a signal) exits as the shell would show it."""
    click.echo(f"gpuwatch launch: error: {message}", err=True)
    sys.exit(128 - code if code < 0 else code)
