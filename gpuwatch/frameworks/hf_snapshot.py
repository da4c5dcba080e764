"""Host snapshots for a Hugging Face Trainer: `GpuwatchCallback(snapshot_every=K)`.

Every K steps the model, optimizer, scheduler and trainer state go to a host snapshot
(`gpuwatch.snapshots.HostSnapshot`, /dev/shm, off the step). HF resumes only from a `checkpoint-N`
directory, so at a resume (the next Trainer's `on_init_end`, before `get_last_checkpoint` looks) the
newest snapshot every rank holds that is newer than the newest verified `checkpoint-N` is written out
as `checkpoint-<its step>` in HF's own layout, sealed; HF's own resume then lands on it. A snapshot
that is missing, older, or torn (a chunk that does not match its checksum) leaves the newest verified
directory in place, with the reason logged.

Not kept: HF's per-rank RNG files (HF resumes without them, saying so) and the data loader's state
(HF skips the batches of the epoch it has done, as for its own checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from gpuwatch.snapshots import HostSnapshot
from gpuwatch.trainer.sealed import commit_sealed, newest_verified

log = logging.getLogger("gpuwatch.frameworks")

TRAINER_STATE = "trainer_state.json"


def write_hf_checkpoint(
    output: Path, step: int, model: Any, state: dict[str, Any], trainer_state_json: str | None
) -> Path:
    """`checkpoint-<step>` in HF's layout from `state` ("model", and "optimizer", "scheduler" when given), sealed.

    Committed by rename (gpuwatch.trainer.sealed.commit_sealed): several writers may race, one wins.
    """
    torch = sys.modules["torch"]
    tmp = output / f".tmp-checkpoint-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, state_dict=state["model"], is_main_process=True)
    for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt")):
        if state.get(key) is not None:
            torch.save(state[key], tmp / name)
    if trainer_state_json is not None:
        (tmp / TRAINER_STATE).write_text(trainer_state_json)
    return commit_sealed(tmp, output / f"checkpoint-{step}", step)


def trainer_state_json(state: Any) -> str:
    """HF's TrainerState as its own `save_to_json` writes it."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


class HfSnapshots:
    """The callback's host snapshots of a data-parallel job (every rank holds the whole state): restore into
    `checkpoint-N` before HF looks, then one every K steps."""

    def __init__(self, every: int, pattern: str, markers: tuple[str, ...], root: str | None = None) -> None:
        if every < 1:
            raise ValueError(f"snapshot_every must be a positive number of steps, not {every}")
        self.every, self.pattern, self.markers, self.root = every, pattern, markers, root
        self.snapshot: HostSnapshot | None = None
        self.restored_step: int | None = None

    def restore_into(self, output: Path, model: Any) -> int | None:
        """Write the newest host snapshot newer than the newest verified `checkpoint-N` as one; its step, or None.

        Every rank calls it (the snapshot's restore agrees across ranks); the lowest rank writes.
        """
        good, _ = newest_verified(output, self.pattern, self.markers)
        disk_step = _step_of(good)
        reader = HostSnapshot(lambda: {}, every=self.every, replicated=True, root=self.root)
        try:
            restored = reader.restore(at_least=None if disk_step is None else disk_step + 1)
            if restored is None:
                reader.resumed_from(disk_step)  # snapshots of steps past the disk's were of an abandoned run
                where = "none newer than the newest verified checkpoint" if disk_step is not None else "none"
                log.warning("gpuwatch: host snapshot: %s; HF resumes from %s", where, good.name if good else "scratch")
                return None
            if reader.rank == 0:
                state = restored.state
                write_hf_checkpoint(output, restored.step, model, state, state.get("trainer_state"))
            log.warning("gpuwatch: restored checkpoint-%d from the host snapshot (%s)", restored.step, restored.where)
            self.restored_step = restored.step
            return restored.step
        finally:
            reader.close(remove=False)

    def start(self, objects: dict[str, Any], trainer_state: Any) -> None:
        """Snapshots of the training objects HF built (model, optimizer, lr_scheduler) from now on."""
        model: Any = objects["model"]
        optimizer, scheduler = objects.get("optimizer"), objects.get("lr_scheduler")
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it

        def state() -> dict[str, Any]:
            return {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "trainer_state": trainer_state_json(trainer_state),
            }

        self.snapshot = HostSnapshot(
            state, every=self.every, optimizer=torch_optimizer, replicated=True, root=self.root
        )

    def step(self, step: int) -> None:
        if self.snapshot is not None:
            self.snapshot.step(step)

    def close(self, *, finished: bool) -> None:
        """Release the slots; a finished job removes them, one that stops for resume keeps them."""
        if self.snapshot is not None:
            self.snapshot.close(remove=finished)
            self.snapshot = None


def _step_of(path: Path | None) -> int | None:
    return None if path is None else int(path.name.rsplit("-", 1)[1])
