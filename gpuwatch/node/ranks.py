"""Which trainer ranks run on which GPU: NVML's process list, /proc/PID/environ and the trainers' reports.

* NVML lists host PIDs per GPU (the truth for where a process has a context); used only for the
  `nvml` and `dcgm` backends: the simulator's and a trace's PIDs are not processes of this host.
* /proc/PID/environ (the environment at exec) gives torchrun's RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE and TORCHELASTIC_RUN_ID (or GPUWATCH_JOB_ID), and CUDA_VISIBLE_DEVICES to resolve
  a rank's GPU by UUID: the entry at LOCAL_RANK is a UUID (prefix) or an NVML index.
* A trainer's own report (TrainerLink) wins where it says something: torch knows its device's UUID.

Anything the daemon may signal must be a trainer (a report, or torchrun's variables in its
environment). Reports come already attributed (gpuwatch.reports: the kernel names each sender's
pid and uid), so one user cannot point the daemon at another user's process. The start time from
/proc/PID/stat travels with each rank so a recycled PID is never signalled. A rank's identity and
environment are read once (ProcFs.known_identity): a round reads each rank's stat, nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuwatch.base.procfs import Identity, ProcFs
from gpuwatch.model import GpuStatus, TrainerInfo
from gpuwatch.trainer.contract import RECOVERY_IN_PLACE

log = logging.getLogger("gpuwatch.ranks")

PID_BACKENDS = frozenset({"nvml", "dcgm"})


JobKey = tuple[int | None, str]
"""A job is its user and its id: two users' jobs are never one, whatever ids they choose."""


@dataclass(frozen=True)
class Rank:
    """One trainer process: what is known of it (merged), its GPU, and how to recognise the same process later."""

    info: TrainerInfo
    gpu: int | None
    uid: int | None
    start_time: int | None
    sources: tuple[str, ...]
    started_t: float | None = None  # when the process started (Unix time): a fault before it never hurt it
    exe: str | None = None  # what it runs: a rank that exec'd another program is no longer that rank

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def job(self) -> str | None:
        return self.info.job_id

    @property
    def job_key(self) -> JobKey | None:
        """(uid, job id), or None for a rank that names no job."""
        return (self.uid, self.info.job_id) if self.info.job_id else None

    @property
    def in_place(self) -> bool:
        """Its job's survivors re-form without it (the report says so): a fault stops this rank alone."""
        return self.info.recovery == RECOVERY_IN_PLACE


def map_ranks(
    gpus: Sequence[GpuStatus],
    reports: Iterable[TrainerInfo],
    proc: ProcFs,
    *,
    use_pids: bool,
) -> list[Rank]:
    """Every trainer rank on this node, with its GPU resolved by UUID.

    Args:
        gpus: the Snapshot's GPUs (their samples' `pids` are NVML's process lists).
        reports: the trainers' live reports, attributed to their processes by gpuwatch.node.runtime.
        proc: where to read environments, owners and start times.
        use_pids: trust the samples' PIDs (only real backends: nvml, dcgm).
    """
    on_gpus: dict[int, list[GpuStatus]] = {}
    if use_pids:
        for gpu in gpus:
            for pid in gpu.sample.pids if gpu.sample is not None else ():
                on_gpus.setdefault(pid, []).append(gpu)
    by_report = {report.pid: report for report in reports}
    ranks = []
    for pid in sorted({*on_gpus, *by_report}):
        identity = proc.known_identity(pid)  # read in full once per process, then only its stat
        env = proc.environ(pid, identity.start_time if identity else None) or {}
        own_report = by_report.get(pid)
        if own_report is None and not ("RANK" in env or "LOCAL_RANK" in env):
            continue  # a CUDA process that is no trainer: never ours to signal
        base = own_report or TrainerInfo(pid=pid)
        own_gpu = _own_gpu(base, env, on_gpus.get(pid, []), gpus)
        sources = [
            name for name, present in (("report", own_report), ("environ", env), ("nvml", on_gpus.get(pid))) if present
        ]
        index = own_gpu.index if own_gpu is not None else None
        uid = base.uid if base.uid is not None else _uid(proc, pid, identity)  # a report's is the kernel's
        filled = _from_env(base, env)  # one replace per rank: a round maps every rank
        info = replace(base, **filled, uid=uid, gpu_uuid=own_gpu.uuid if own_gpu is not None else base.gpu_uuid)
        ranks.append(
            Rank(
                info,
                index,
                uid,
                identity.start_time if identity else None,
                tuple(sources),
                started_t=identity.started_t if identity else None,
                exe=identity.exe if identity else None,
            )
        )
    return ranks


def _uid(proc: ProcFs, pid: int, identity: Identity | None) -> int | None:
    """The real uid from the identity just read (ProcFs.uid would read it all again)."""
    if identity is not None and identity.uids:
        return identity.uids[0]
    return proc.uid(pid)


def resolve_gpu(env: Mapping[str, str], gpus: Sequence[GpuStatus]) -> GpuStatus | None:
    """The GPU a torchrun worker uses: CUDA_VISIBLE_DEVICES at LOCAL_RANK (the one entry if only one).

    An entry is a UUID or an unambiguous UUID prefix ("GPU-8932f937"), or an NVML index; unset means
    every GPU, in NVML's order. MIG instances are not resolved.
    """
    local = _int(env.get("LOCAL_RANK")) or 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        entry = str(local)
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if not entries:
            return None
        entry = entries[0] if len(entries) == 1 else (entries[local] if local < len(entries) else "")
    if entry.startswith("GPU-"):
        matches = [g for g in gpus if g.uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    index = _int(entry)
    return next((g for g in gpus if g.index == index), None) if index is not None else None


def _own_gpu(
    info: TrainerInfo, env: Mapping[str, str], listed: Sequence[GpuStatus], gpus: Sequence[GpuStatus]
) -> GpuStatus | None:
    """The report's UUID; else the one GPU NVML lists; else (a stray context elsewhere) the environ's pick."""
    if info.gpu_uuid:
        return next((g for g in gpus if g.uuid == info.gpu_uuid), None)
    if len(listed) == 1:
        return listed[0]
    from_env = resolve_gpu(env, gpus)
    if listed and from_env not in listed:
        return listed[0]
    return from_env


def _from_env(report: TrainerInfo, env: Mapping[str, str]) -> dict[str, Any]:
    """What the report does not say, filled from the environment (fields for `replace`)."""
    return {
        "rank": _first(report.rank, env.get("RANK")),
        "local_rank": _first(report.local_rank, env.get("LOCAL_RANK")),
        "world_size": _first(report.world_size, env.get("WORLD_SIZE")),
        "local_world_size": _first(report.local_world_size, env.get("LOCAL_WORLD_SIZE")),
        "job_id": report.job_id or env.get("TORCHELASTIC_RUN_ID") or env.get("GPUWATCH_JOB_ID") or None,
    }


def _first(value: int | None, fallback: str | None) -> int | None:
    return value if value is not None else _int(fallback)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
