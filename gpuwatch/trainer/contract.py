"""The runtime directory's files and the trainer's exit code, spelled once for both sides.

The daemon (gpuwatch.runtime, gpuwatch.remediation) reads what the trainer side
(gpuwatch.trainer.TrainerLink) writes, the trainer side reads the daemon's status.json, and the
launcher reads the exit code and the reports. stdlib only: the trainer side imports nothing but
the stdlib, gpuwatch.model and gpuwatch.errors.

A rank's report, `trainers/<pid>.json` (temp file + rename), is one flat JSON object, TrainerReport.
Its last report stays after the process exits; the daemon removes it once it has read it, so a
rank that vanishes while its report still says `ended: null` (SIGKILL, a crash of the
interpreter) or `"error"` died.
"""

from __future__ import annotations

import re
from typing import Any, TypedDict

EXIT_RESUME = 75
"""Exit code of a rank that stopped on request (or rescued its peers' state) after a verified checkpoint."""

DEFAULT_RUNTIME_DIR = "/run/gpuwatch"
RUNTIME_DIR_ENV = "GPUWATCH_RUNTIME_DIR"
STATUS_FILE = "status.json"
TRAINERS_DIR = "trainers"
_REPORT_SUFFIX = ".json"
MAX_REPORT_BYTES = 64 * 1024
"""A report larger than this is not read (a rank's report is under 1 KiB)."""

ENDED_FINISHED = "finished"  # the job's loop ended normally (TrainerLink closed without an exception)
ENDED_RESUME = "resume"  # exit_for_resume: checkpoint saved, relaunch and resume
ENDED_ERROR = "error"  # the rank's code raised out of the TrainerLink context
ENDED_VALUES = (ENDED_FINISHED, ENDED_RESUME, ENDED_ERROR)

RECOVERY_RELAUNCH = "relaunch"  # a fault ends the job's ranks; the launcher relaunches and they load
RECOVERY_IN_PLACE = "in_place"  # the survivors go on in the same processes (gpuwatch.inplace)

_REPORT_NAME = re.compile(rf"^([1-9][0-9]{{0,6}}){re.escape(_REPORT_SUFFIX)}$")


def report_name(pid: int) -> str:
    """The file name of rank `pid`'s report inside TRAINERS_DIR."""
    return f"{pid}{_REPORT_SUFFIX}"


def report_pid(name: str) -> int | None:
    """The pid whose report `name` is (the inverse of report_name), or None for any other entry."""
    match = _REPORT_NAME.match(name)
    return int(match.group(1)) if match else None


class AllocatorFigures(TypedDict):
    """The caching allocator's counters for the rank's device (null without torch or before CUDA is up)."""

    reserved_bytes: int | None
    allocated_bytes: int | None
    inactive_split_bytes: int | None
    num_alloc_retries: int | None
    num_ooms: int | None


class TrainerReport(AllocatorFigures):
    """`trainers/<pid>.json`; null: not known. TrainerLink writes every key (the allocator's after grad_norm_var)."""

    t: float  # Unix seconds of the write
    pid: int  # must equal the file name
    rank: int | None
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    job_id: str | None
    gpu_uuid: str | None
    step: int | None  # the last step finished
    first_step: int | None  # the first step this process finished: a relaunch resumed from first_step - 1
    step_time_s: float | None
    grad_norm: float | None
    grad_norm_var: float | None
    stop_requested: bool
    allow_drills: bool  # the rank accepts the fault-rank drill
    ended: str | None  # null while the process runs, else how it ended (ENDED_*)
    recovery: str  # RECOVERY_RELAUNCH or RECOVERY_IN_PLACE: how the job recovers from a fault


class StatusGpu(TypedDict):
    """One GPU in status.json."""

    index: int
    uuid: str
    state: str
    quarantined: bool
    epoch: int
    findings: list[dict[str, Any]]  # gpuwatch.model.Finding.as_dict()


class Status(TypedDict):
    """`status.json`, written by the daemon after every judgement: a rank stops when its GPU is quarantined."""

    t: float
    gpus: list[StatusGpu]


def quarantined_in(status: object, gpu_uuid: str) -> bool:
    """Whether a status.json body (parsed, not yet checked) says the GPU `gpu_uuid` is quarantined."""
    gpus = status.get("gpus") if isinstance(status, dict) else None
    return isinstance(gpus, list) and any(
        isinstance(gpu, dict) and gpu.get("uuid") == gpu_uuid and gpu.get("quarantined") is True for gpu in gpus
    )
