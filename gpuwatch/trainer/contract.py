"""The trainer contract, spelled once for both sides: the report socket, the step page, status.json, exit 75.

The daemon (gpuwatch.reports, gpuwatch.remediation) reads what the trainer side
(gpuwatch.trainer.TrainerLink) sends, the trainer side reads the daemon's status.json, and the
launcher reads the exit code and the step pages. stdlib only: the trainer side imports nothing but
the stdlib, gpuwatch.model and gpuwatch.errors.

Reports travel over REPORT_SOCKET, a SOCK_SEQPACKET Unix socket in the daemon's root-owned runtime
directory: one flat JSON object (TrainerReport) per message, at most MAX_REPORT_BYTES. The kernel
tells the daemon who connected (SO_PEERCRED: pid and uid), so no rank can speak for another
process, and nothing a user does fills a directory that other users or the daemon need. A rank's
last report stays in the daemon after the process exits, so a rank that vanishes while its report
still says `ended: null` (SIGKILL, a crash of the interpreter) or `"error"` died.

The first message of a connection carries, as SCM_RIGHTS, the rank's step page: STEP_PAGE_BYTES
that `TrainerLink.step()` rewrites in memory at every step (no syscall), so the last step survives
the rank exactly, wherever its last report stopped. Under `gpuwatch launch` the page is a file
`<pid>.step` in the launch's own directory ($GPUWATCH_LAUNCH_DIR, private to the job's user), which
the launcher reads after the rank is gone; otherwise it is an anonymous memfd.

Each side says which version of this protocol it speaks (REPORT_PROTOCOL): the rank's first message
on a connection is a hello, `{"hello": "gpuwatch", "protocol": N, "pid": P}` (with the step page),
and the daemon greets every connection it takes with `{"hello": "gpuwatch", "protocol": N}`. A side
that finds another version, or none (a gpuwatch from before the hello: version 1), says so in one
line; reports keep flowing as far as both understand them.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, TypedDict

EXIT_RESUME = 75
"""Exit code of a rank that stopped on request (or rescued its peers' state) after a verified checkpoint."""

DEFAULT_RUNTIME_DIR = "/run/gpuwatch"
RUNTIME_DIR_ENV = "GPUWATCH_RUNTIME_DIR"
STATUS_FILE = "status.json"
REPORT_SOCKET = "trainers.sock"
REPORT_PROTOCOL = 2
"""The report protocol's version. 1: the same reports, no hello (gpuwatch before it had one)."""
MAX_REPORT_BYTES = 8 * 1024
"""A report message larger than this is dropped (a rank's report is under 1 KiB)."""
LAUNCH_DIR_ENV = "GPUWATCH_LAUNCH_DIR"
"""Set by `gpuwatch launch` for its ranks: a directory only the job's user can write, for the step pages."""
REPORTS_REQUIRED_ENV = "GPUWATCH_REPORTS_REQUIRED"
"""Set by `gpuwatch launch`, which gives its ranks the daemon's own runtime dir: a rank that cannot reach the
report socket there at start raises ReportsUnreachable (no daemon could stop it) instead of warning."""
STEP_PAGE_SUFFIX = ".step"

ENDED_FINISHED = "finished"  # the job's loop ended normally (TrainerLink closed without an exception)
ENDED_RESUME = "resume"  # exit_for_resume: checkpoint saved, relaunch and resume
ENDED_ERROR = "error"  # the rank's code raised out of the TrainerLink context
ENDED_VALUES = (ENDED_FINISHED, ENDED_RESUME, ENDED_ERROR)

RECOVERY_RELAUNCH = "relaunch"  # a fault stops the job; it comes back through a relaunch (launch, torchrun)
RECOVERY_IN_PLACE = "in_place"  # the surviving ranks re-form without the rank that left and keep training
RECOVERY_VALUES = (RECOVERY_RELAUNCH, RECOVERY_IN_PLACE)
SPARE_WARM_S_ENV = "GPUWATCH_SPARE_WARM_S"
SPARE_STAGE_ENV = "GPUWATCH_SPARE_STAGE"  # how far a spare was at its hand-over: SPARE_STAGES
SPARE_STAGES = ("standby", "warm", "starting")  # the job's set-up done up to its join; torch imported; neither
"""Set in a rank's environment when a warm spare took the rank over (gpuwatch.spares): the seconds it waited warm.
A rank with it reports `spare: true`, so the daemon records that a spare brought its job back."""
STANDBY_BESIDE_ENV = "GPUWATCH_STANDBY_BESIDE"
"""Set to "1" by `gpuwatch launch --in-place` for its ranks when it keeps standbys of the job beside them: host
snapshots then leave a standby's room on the GPU by default (gpuwatch.snapshots.budget)."""
FREEING_ENV = "GPUWATCH_GPU_FREEING"
"""Set by `gpuwatch launch --in-place` for a rank that replaces one whose process still held GPU memory at the
hand-over: "<pid>:<bytes>", that process and what NVML said it held. While that process exists its memory is
about to be freed, and the replacement's staging budget counts it as free (gpuwatch.snapshots.budget)."""

_STEP_PAGE_NAME = re.compile(rf"^([1-9][0-9]{{0,6}}){re.escape(STEP_PAGE_SUFFIX)}$")

STEP_PAGE_BYTES = 64
STEP_PAGE_MAGIC = b"GWSTEP1\0"
STEP_LAYOUT = struct.Struct("<8sqqdd")
"""magic, step, first_step, step_t, first_step_t, then (PAUSE_LAYOUT) pause_until: 8-byte aligned slots, each
rewritten by one aligned store.

`step` and `first_step` are NO_STEP before the first step; `step_t` is the Unix time `step()` was
called for `step`, `first_step_t` for `first_step`. A reader may see a step with the time of the
one before it (the two are stored one after the other), never a torn value. `pause_until` is 0
until the loop declares a pause (`TrainerLink.pause()`): while one runs, the Unix time it is
declared to last until; once it ended, the time it ended (the rank's last sign of progress, as a
step is). A page of an older link has 0 there.
"""
STEP_SLOT, FIRST_STEP_SLOT, STEP_T_SLOT, FIRST_STEP_T_SLOT, PAUSE_UNTIL_SLOT = 1, 2, 3, 4, 5  # the 8-byte slots
PAUSE_LAYOUT = struct.Struct("<d")  # at PAUSE_UNTIL_SLOT * 8: added after STEP_LAYOUT, so older pages read 0
NO_STEP = -1


@dataclass(frozen=True)
class StepPage:
    """What a step page says: the last step finished, the first one of this process, and when the last ended."""

    step: int | None
    first_step: int | None
    step_t: float | None
    first_step_t: float | None = None
    pause_until: float | None = None  # the declared pause's end (in force or past), None when none was declared


def step_page_name(pid: int) -> str:
    """The file name of rank `pid`'s step page inside the launch directory."""
    return f"{pid}{STEP_PAGE_SUFFIX}"


def step_page_pid(name: str) -> int | None:
    """The pid whose step page `name` is (the inverse of step_page_name), or None for any other entry."""
    match = _STEP_PAGE_NAME.match(name)
    return int(match.group(1)) if match else None


def read_step_page(data: bytes) -> StepPage | None:
    """The page's figures, or None when it is no page or says nonsense."""
    if len(data) < STEP_LAYOUT.size:
        return None
    magic, step, first, step_t, first_t = STEP_LAYOUT.unpack_from(data)
    has_pause = len(data) >= PAUSE_UNTIL_SLOT * 8 + PAUSE_LAYOUT.size
    (pause_until,) = PAUSE_LAYOUT.unpack_from(data, PAUSE_UNTIL_SLOT * 8) if has_pause else (0.0,)
    if magic != STEP_PAGE_MAGIC or step < NO_STEP or first < NO_STEP:
        return None
    if not all(math.isfinite(t) and t >= 0 for t in (step_t, first_t, pause_until)):
        return None
    if step == NO_STEP:
        return StepPage(None, None, None, None, pause_until or None)
    return StepPage(step, first if first != NO_STEP else None, step_t, first_t or None, pause_until or None)


class AllocatorFigures(TypedDict):
    """The caching allocator's counters for the rank's device (null without torch or before CUDA is up)."""

    reserved_bytes: int | None
    allocated_bytes: int | None
    inactive_split_bytes: int | None
    num_alloc_retries: int | None
    num_ooms: int | None


class TrainerReport(AllocatorFigures):
    """One message on `trainers.sock`; null: not known.

    TrainerLink sends every key (the allocator's after grad_norm_var).
    """

    t: float  # Unix seconds of the write
    pid: int  # must equal the sender's pid, which the kernel names (SO_PEERCRED)
    rank: int | None
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    job_id: str | None
    gpu_uuid: str | None
    step: int | None  # the last step finished
    first_step: int | None  # the first step this process finished: a relaunch resumed from first_step - 1
    first_step_t: float | None  # Unix time it finished
    step_t: float | None  # Unix time the last step finished
    step_time_s: float | None  # the mean of the last 20 step times
    step_time_p99_s: float | None  # the 99th percentile of the last 100
    grad_norm: float | None
    grad_norm_var: float | None
    stop_requested: bool
    allow_drills: bool  # the rank accepts the fault-rank drill
    spare: bool  # this process took its rank over as a warm spare (SPARE_WARM_S_ENV)
    spare_stage: str | None  # ... and how far it was then (SPARE_STAGE_ENV): standby, warm or starting
    recovery: str  # RECOVERY_RELAUNCH, or RECOVERY_IN_PLACE: its job's survivors go on when it leaves
    ended: str | None  # null while the process runs, else how it ended (ENDED_*)
    pause: str | None  # the pause the loop declared and is in (TrainerLink.pause), else null
    pause_until: float | None  # its declared end (Unix time); the step page's slot is the exact word


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


def hello(pid: int | None = None) -> bytes:
    """A hello message: the rank's (with its pid) or the daemon's (without)."""
    body: dict[str, Any] = {"hello": "gpuwatch", "protocol": REPORT_PROTOCOL}
    if pid is not None:
        body["pid"] = pid
    return json.dumps(body).encode()


EXIT_NOTE_PREFIX = b'{"rank_exit"'
"""An exit note, sent on the report socket by the launcher that started a rank (`gpuwatch launch --in-place`):
`{"rank_exit": {"pid": P, "t": T}}`, T the Unix time the launcher saw the rank's exit begin. The daemon dates
that rank's death by it (a kill's teardown ends seconds later) and takes it only from the rank's parent."""


def exit_note(pid: int, t: float) -> bytes:
    """The exit note of rank `pid`, whose exit began at Unix time `t`."""
    return json.dumps({"rank_exit": {"pid": pid, "t": round(t, 6)}}).encode()


def hello_protocol(data: bytes) -> int | None:
    """The protocol version a hello message names (0 for a hello that names none sensibly), or None: no hello."""
    if not data.startswith(b'{"hello"'):
        return None
    try:
        version = json.loads(data).get("protocol")
    except (ValueError, RecursionError, AttributeError):
        return 0
    return version if type(version) is int and 0 < version < 1 << 20 else 0


def quarantined_in(status: object, gpu_uuid: str) -> bool:
    """Whether a status.json body (parsed, not yet checked) says the GPU `gpu_uuid` is quarantined."""
    gpus = status.get("gpus") if isinstance(status, dict) else None
    return isinstance(gpus, list) and any(
        isinstance(gpu, dict) and gpu.get("uuid") == gpu_uuid and gpu.get("quarantined") is True for gpu in gpus
    )
