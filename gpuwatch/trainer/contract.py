"""The runtime directory's files and the trainer's exit code, spelled once for both sides.

The daemon (gpuwatch.runtime, gpuwatch.remediation) reads what the trainer side
(gpuwatch.trainer.TrainerLink) writes, and the launcher reads the exit code. stdlib only:
the trainer side imports nothing but the stdlib, gpuwatch.model and gpuwatch.errors.

A rank's report, `trainers/<pid>.json` (temp file + rename), is one flat JSON object:

* identity: `pid` (must equal the file name), `rank`, `local_rank`, `world_size`,
  `local_world_size`, `job_id`, `gpu_uuid`;
* progress: `t` (Unix seconds of the write), `step` (the last step finished), `first_step` (the
  first step this process finished: a relaunch resumed from `first_step - 1`), `step_time_s`;
* training health: `grad_norm`, `grad_norm_var`, the allocator counters `reserved_bytes`,
  `allocated_bytes`, `inactive_split_bytes`, `num_alloc_retries`, `num_ooms`;
* control: `stop_requested`, `allow_drills` (the rank accepts the fault-rank drill), and `ended`:
  null while the process runs, else how it ended (ENDED_*). The last report stays after the
  process exits; the daemon removes it once it has read it, so a rank that vanishes while its
  report still says `ended: null` (SIGKILL, a crash of the interpreter) or `"error"` died.
"""

from __future__ import annotations

EXIT_RESUME = 75
"""Exit code of a rank that stopped on request (or rescued its peers' state) after a verified checkpoint."""

DEFAULT_RUNTIME_DIR = "/run/gpuwatch"
RUNTIME_DIR_ENV = "GPUWATCH_RUNTIME_DIR"
STATUS_FILE = "status.json"
TRAINERS_DIR = "trainers"
MAX_REPORT_BYTES = 64 * 1024
"""A report larger than this is not read (a rank's report is under 1 KiB)."""

ENDED_FINISHED = "finished"  # the job's loop ended normally (TrainerLink closed without an exception)
ENDED_RESUME = "resume"  # exit_for_resume: checkpoint saved, relaunch and resume
ENDED_ERROR = "error"  # the rank's code raised out of the TrainerLink context
ENDED_VALUES = (ENDED_FINISHED, ENDED_RESUME, ENDED_ERROR)


def report_name(pid: int) -> str:
    """The file name of rank `pid`'s report inside TRAINERS_DIR."""
    return f"{pid}.json"
