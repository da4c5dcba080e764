"""Host-memory snapshots that outlive the rank: the training state in /dev/shm, every K steps, off the step.

`HostSnapshot` keeps it (trainer side: stdlib, torch, gpuwatch.trainer); `prune` (gpuwatch.snapshots.prune)
is the daemon's side, removing the slots of jobs that have no live rank. docs/snapshots.md is the user guide.
"""

from __future__ import annotations

from gpuwatch.snapshots.cadence import choose_every
from gpuwatch.snapshots.copier import DIE_BEFORE_COMMIT_ENV
from gpuwatch.snapshots.layout import ROOT_ENV, job_dir_name, snapshot_root, user_dir_name
from gpuwatch.snapshots.restore import pin_restore_buffers
from gpuwatch.snapshots.snapshot import HostSnapshot, Restored

__all__ = [
    "DIE_BEFORE_COMMIT_ENV",
    "ROOT_ENV",
    "HostSnapshot",
    "Restored",
    "choose_every",
    "job_dir_name",
    "pin_restore_buffers",
    "snapshot_root",
    "user_dir_name",
]
