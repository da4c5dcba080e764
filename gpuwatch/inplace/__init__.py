"""Recovery in place: a data-parallel job whose survivors go on in the same processes when a rank
leaves, dies or hangs, and whose returning GPUs get the state from a peer, never from disk.

Trainer side: one step engine (gpuwatch.inplace.engine) with a state source per job shape: `InPlaceJob`
(DDP, gpuwatch.inplace.job), `ShardedJob` (ZeRO and one-rank jobs, gpuwatch.inplace.sharded) and `FSDPJob`
(FSDP2 and DTensor meshes, gpuwatch.inplace.fsdp); stdlib and torch only, like gpuwatch.trainer.
Launcher side: `gpuwatch launch --in-place` (gpuwatch.launcher.in_place) runs the workers and
hosts the job's store. `measure_in_place` (gpuwatch.bench.recovery_in_place) times it for `gpuwatch bench`.
"""

from __future__ import annotations

from gpuwatch.inplace.job import Change, InPlaceJob, NotInPlace
from gpuwatch.inplace.transfer import checksum, send_state

__all__ = ["Change", "InPlaceJob", "NotInPlace", "checksum", "send_state"]
