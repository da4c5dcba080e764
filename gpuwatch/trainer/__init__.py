"""The trainer side of gpuwatch: what a training rank imports (stdlib only; torch used when present).

`TrainerLink` reports the rank to the node's daemon and tells the loop when to stop;
`save_checkpoint` / `load_latest` give the verified checkpoints to resume from.
"""

from __future__ import annotations

from gpuwatch.trainer.checkpoint import (
    LoadedCheckpoint,
    commit_checkpoint,
    load_latest,
    new_temp_dir,
    save_checkpoint,
    verify_checkpoint,
)
from gpuwatch.trainer.link import EXIT_RESUME, TrainerLink, bench_step

__all__ = [
    "EXIT_RESUME",
    "LoadedCheckpoint",
    "TrainerLink",
    "bench_step",
    "commit_checkpoint",
    "load_latest",
    "new_temp_dir",
    "save_checkpoint",
    "verify_checkpoint",
]
