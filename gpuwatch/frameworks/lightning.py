"""PyTorch Lightning: `callbacks=[..., GpuwatchLightning()]` and Lightning's own `fit(ckpt_path="last")`.

    checkpoints = ModelCheckpoint(dirpath=CKPT_DIR, every_n_train_steps=50, save_last=True)
    trainer = L.Trainer(..., callbacks=[checkpoints, GpuwatchLightning()])
    trainer.fit(model, data, ckpt_path="last")

What the callback does with Lightning's hooks:

* `setup`: wraps the strategy's CheckpointIO (`VerifiedCheckpointIO`): every `.ckpt` Lightning
  saves is sealed (`<name>.ckpt.manifest.json` beside it), and a load of one that does not verify
  (cut short, changed, never sealed) loads the newest one in its directory that does, saying why.
* `on_train_start`, a resume mid-epoch: the train loader goes on with the batch after the last one
  trained, not the epoch's first (gpuwatch.frameworks.lightning_data), so the loss goes on as an
  uninterrupted run's.
* `on_train_start`, after Lightning set its own signal handlers: the TrainerLink's handlers chain to
  them, so Lightning's SLURM requeue (SIGUSR1) and SIGTERM handling keep working.
* each batch: reports the step and takes part in the stop agreement; when every rank agreed it
  saves `last-gpuwatch.ckpt` through Lightning's own `trainer.save_checkpoint` (every rank) and
  exits 75 for `gpuwatch launch` to relaunch; `ckpt_path="last"` finds it.
* Lightning's own save (`on_save_checkpoint`) and validation are declared a pause until the next
  batch: a rank that waits in a barrier for a slow save is no hang.
* `on_exception` (a peer died): a survivor saves the last completed step alone as
  `last-gpuwatch-rank<R>.ckpt` and exits 75. Lightning's public `save_checkpoint` ends in a barrier
  that a dead peer never reaches, so this one save uses `trainer._checkpoint_connector.dump_checkpoint()`.
  Not with sharded strategies (FSDP, DeepSpeed, model parallel): no rank holds the whole state.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from gpuwatch.frameworks.in_place import refuse_in_place
from gpuwatch.frameworks.lightning_data import skip_trained_batches
from gpuwatch.trainer.hooks import TrainingHooks
from gpuwatch.trainer.link import TrainerLink
from gpuwatch.trainer.sealed import FILE_MANIFEST_SUFFIX, seal_file, why_unverified_file

log = logging.getLogger("gpuwatch.frameworks")

STOP_CHECKPOINT = "last-gpuwatch.ckpt"  # Lightning's ckpt_path="last" takes the newest `last*.ckpt`


class VerifiedCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO with a manifest beside each checkpoint, verified before a load."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)
        seal_file(path, int(checkpoint.get("global_step", 0)))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        chosen = Path(path)
        reason = why_unverified_file(chosen)
        if reason is not None:
            log.warning("skipped checkpoint %s: %s", chosen.name, reason)
            chosen = _newest_verified_beside(chosen)
            log.warning("resuming from %s, the newest checkpoint that verifies", chosen.name)
        loaded: dict[str, Any] = self.inner.load_checkpoint(chosen, map_location, weights_only)
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        Path(f"{path}{FILE_MANIFEST_SUFFIX}").unlink(missing_ok=True)

    def teardown(self) -> None:
        self.inner.teardown()


def _newest_verified_beside(path: Path) -> Path:
    """The newest (by mtime) `.ckpt` in `path`'s directory that verifies; FileNotFoundError when none does."""
    candidates = sorted(path.parent.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in candidates:
        if candidate == path:
            continue
        reason = why_unverified_file(candidate)
        if reason is None:
            return candidate
        log.warning("skipped checkpoint %s: %s", candidate.name, reason)
    raise FileNotFoundError(f"no checkpoint in {path.parent} verifies")


class GpuwatchLightning(pl.Callback):
    """gpuwatch's stop, rescue and verified resume for a Lightning Trainer.

    Args:
        link: the rank's TrainerLink; default: a new one, made when training starts (after
            Lightning's own signal handlers, which it chains to).
    """

    def __init__(self, link: TrainerLink | None = None) -> None:
        self._link = link
        self.hooks: TrainingHooks | None = None
        self._trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        refuse_in_place("Lightning")
        if not isinstance(trainer.strategy.checkpoint_io, VerifiedCheckpointIO):
            trainer.strategy.checkpoint_io = VerifiedCheckpointIO(trainer.strategy.checkpoint_io)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        skip_trained_batches(trainer)
        replicated = isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy))
        self.hooks = TrainingHooks(self._link, save=self._rescue_save if replicated else None)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if self.hooks is not None:
            self.hooks.begin_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self.hooks is None:
            return
        if self.hooks.end_step(trainer.global_step, _cpu_loss(outputs)):
            trainer.save_checkpoint(_checkpoint_dir(trainer) / STOP_CHECKPOINT)  # every rank; rank 0 writes
            self.hooks.exit_for_resume()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning's save begins (every rank; rank 0 then writes, the others wait in a barrier): a pause."""
        if self.hooks is not None:
            self.hooks.begin_pause("checkpoint")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hooks is not None:
            self.hooks.begin_pause("evaluation")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.hooks is not None:
            self.hooks.failure(exception)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None

    def _rescue_save(self, step: int) -> None:
        """A survivor's save of `step`, alone (no barrier): `last-gpuwatch-rank<R>.ckpt`, sealed."""
        trainer = self._trainer
        if trainer is None or trainer.global_step != step:
            held = None if trainer is None else trainer.global_step
            log.error("gpuwatch: no rescue: the trainer holds step %s, not the last completed step %d", held, step)
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        path = _checkpoint_dir(trainer) / f"last-gpuwatch-rank{trainer.global_rank}.ckpt"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        sys.modules["torch"].save(checkpoint, tmp)
        os.replace(tmp, path)
        seal_file(path, step)
        log.warning("gpuwatch: rescued %s (step %d)", path.name, step)


def _checkpoint_dir(trainer: pl.Trainer) -> Path:
    """Where ModelCheckpoint saves (and `ckpt_path="last"` looks), else the trainer's root dir."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return Path(str(dirpath or trainer.default_root_dir))


def _cpu_loss(outputs: Any) -> float | None:
    """The step's loss when it is on the CPU (a GPU tensor's `.item()` would sync the step)."""
    loss: Any = outputs.get("loss") if isinstance(outputs, dict) else outputs
    device = getattr(loss, "device", None)
    if device is not None and device.type == "cpu" and loss.numel() == 1:
        return float(loss.item())
    return None
