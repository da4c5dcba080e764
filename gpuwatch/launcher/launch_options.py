"""`gpuwatch launch`'s options, and the checks on what the user gave before anything starts.

Every mistake a user can make on the command line is one line and exit 2 (`fail`) before the daemon is
asked or a process starts: a job that is not `[-m] SCRIPT`, no torch in this Python, a multi-node job
without a job id, torchrun's rendezvous flags given to --in-place, which runs its own store.

Locking: none. Pure checks, run once in the command's thread.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import click

from gpuwatch.base.command_error import fail
from gpuwatch.launcher.join_watch import DEFAULT_JOIN_WITHIN_S
from gpuwatch.launcher.launch_plan import COMMAND
from gpuwatch.launcher.torchrun_args import SINGLE_NODE

SPARES_NEED_IN_PLACE = (
    "--spares needs --in-place: torchrun starts each worker itself as a new interpreter and stops every worker"
    " when one fails, so there is no rank to hand to a warm spare"
)

F = TypeVar("F", bound=Callable[..., Any])


class Nproc(click.ParamType):
    """--nproc-per-node: a positive number, or `auto` (None: every usable GPU)."""

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


_OPTIONS = (
    click.option(
        "--nproc-per-node", "nproc", type=Nproc(), default="auto", show_default=True, help="Ranks per launch."
    ),
    click.option("--min-nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Stop below this."),
    click.option(
        "--max-restarts", type=click.IntRange(min=0), default=3, show_default=True, help="Relaunches at most."
    ),
    click.option(
        "--runtime-dir", help="Only checked: the ranks get the daemon's own runtime dir (a different one: exit 2)."
    ),
    click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file."),
    click.option("--listen", help="HOST:PORT of the daemon's API (default 127.0.0.1:9835)."),
    click.option("--state-dir", help="The daemon's state dir."),
    click.option("--nnodes", help="torchrun --nnodes (MIN:MAX)."),
    click.option("--rdzv-backend", help="torchrun --rdzv-backend."),
    click.option("--rdzv-endpoint", help="torchrun --rdzv-endpoint."),
    click.option("--rdzv-id", help="torchrun --rdzv-id; also the job id (default $GPUWATCH_JOB_ID or a new one)."),
    click.option("--rdzv-conf", help="torchrun --rdzv-conf."),
    click.option("--node-rank", type=click.IntRange(min=0), help="torchrun --node-rank."),
    click.option("--master-addr", help="torchrun --master-addr."),
    click.option("--master-port", type=click.IntRange(1, 65535), help="torchrun --master-port."),
    click.option("--standalone", is_flag=True, help="Single node (the default when no rendezvous option is given)."),
    click.option(
        "--in-place", is_flag=True, help="Recover in place: run the workers here, survivors go on (gpuwatch.inplace)."
    ),
    click.option(
        "--inplace-secret-file",
        help="--in-place with --rdzv-endpoint: your file (mode 600) holding the job's secret, the same on every node.",
    ),
    click.option(
        "--join-within",
        type=click.FloatRange(min=0, min_open=True),
        default=DEFAULT_JOIN_WITHIN_S,
        show_default=True,
        help="--in-place: refuse the job (exit 2) when none of its workers joined it (InPlaceJob) by then, in seconds.",
    ),
    click.option(
        "--spares",
        type=click.IntRange(min=0),
        help="Warm standby workers (--in-place only; default trainer.spares).",
    ),
)


def launch_options(command: F) -> F:
    """The command with every option of `gpuwatch launch`, in the order --help lists them."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def check_job(command: tuple[str, ...]) -> None:
    """The job is `[-m] SCRIPT [ARGS]...` and this Python, which runs torchrun and the job, has torch."""
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


def job_id_for(rdzv_id: str | None, nnodes: str | None) -> str:
    """The job's id: --rdzv-id, else $GPUWATCH_JOB_ID, else a new one (a multi-node job must name it)."""
    if nnodes not in SINGLE_NODE and not (rdzv_id or os.environ.get("GPUWATCH_JOB_ID")):
        fail("a multi-node job needs --rdzv-id, the same on every node (it is also the job id)", command=COMMAND)
    return rdzv_id or os.environ.get("GPUWATCH_JOB_ID") or f"gpuwatch-{uuid.uuid4().hex[:12]}"


def check_in_place_flags(rendezvous: dict[str, Any], secret_file: str | None) -> None:
    """--in-place runs its own store: torchrun's rendezvous flags are one line and exit 2."""
    torchrun_only = ("rdzv_conf", "node_rank", "master_addr", "master_port")
    given = [f"--{k.replace('_', '-')}" for k in torchrun_only if rendezvous[k] is not None]
    given += ["--rdzv-backend"] if rendezvous["rdzv_backend"] not in (None, "c10d") else []
    if given:
        fail(f"--in-place runs its own store: {', '.join(given)} apply to torchrun only", command=COMMAND)
    if rendezvous["nnodes"] not in SINGLE_NODE and not rendezvous["rdzv_endpoint"]:
        fail("a multi-node --in-place job needs --rdzv-endpoint HOST:PORT (its store)", command=COMMAND)
    if rendezvous["rdzv_endpoint"] and not secret_file:
        fail("--in-place with --rdzv-endpoint needs --inplace-secret-file (the job's secret)", command=COMMAND)
