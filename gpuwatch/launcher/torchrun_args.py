"""torchrun's command line for one launch: its fixed options, the rendezvous, and the job.

torchrun never restarts the job itself (`--max-restarts 0`: the launcher relaunches, on the GPUs usable
then), and a single node uses our own rendezvous (gpuwatch.launcher.local_rendezvous): no state anyone
can plant, the workers' store on loopback. Multi-node rendezvous options pass through, with the run id
pinned to the job id.

Locking: none. Pure functions of their arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gpuwatch.launcher.job_args import LOCAL_RENDEZVOUS, torchrun_job_args
from gpuwatch.launcher.torchrun_output import TEE_ARGS
from gpuwatch.launcher.worker_plane import secured_job_args

TORCHRUN = (sys.executable, "-m", "gpuwatch.launcher.local_rendezvous")  # torchrun, with our one-node rendezvous
SINGLE_NODE = {None, "1", "1:1"}  # the --nnodes values of a one-node job


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
    custom = any(v is not None for v in given.values()) or nnodes not in SINGLE_NODE
    if standalone and custom:
        raise click.UsageError("--standalone cannot be combined with --nnodes or rendezvous options")
    conf = ("--rdzv-conf", rdzv_conf) if rdzv_conf else ()
    if not custom:
        local = ("--rdzv-backend", LOCAL_RENDEZVOUS, "--rdzv-endpoint", "127.0.0.1:0")
        return ("--nnodes", "1", *local, "--rdzv-id", job_id, *conf)
    args = [arg for flag, value in given.items() if value is not None for arg in (flag, str(value))]
    return (*(("--nnodes", nnodes) if nnodes else ()), *args, "--rdzv-id", job_id, *conf)


def local(rendezvous: tuple[str, ...]) -> bool:
    """Whether `rendezvous` is our own one-node rendezvous (its workers prove the launch's secret)."""
    return LOCAL_RENDEZVOUS in rendezvous


def torchrun_argv(nproc: int, log_dir: Path, rendezvous: tuple[str, ...], command: tuple[str, ...]) -> list[str]:
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
        *rendezvous,
        *(secured_job_args(command, sys.executable) if local(rendezvous) else torchrun_job_args(command)),
    ]
