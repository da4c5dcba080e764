"""Hugging Face Trainer: `Trainer(..., callbacks=[GpuwatchCallback()])`, and HF's own resume.

    trainer = Trainer(model, args, train_dataset=data, callbacks=[GpuwatchCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))

What the callback does with HF's own events:

* built (`on_init_end`, before `train()` looks for a checkpoint): the newest `checkpoint-N` that do
  not verify (no manifest: a save that never finished; a file cut short or missing; HF's own
  `checkpoint-is-incomplete.txt`) are set aside with their reason, so `get_last_checkpoint`
  returns the newest good one.
* each step: reports it (with the last logged loss) and takes part in the stop agreement; when
  every rank agreed, it asks HF for a save at that step and the end of training. A stop agreed at
  the last step (`max_steps`) lets the job finish there instead (exit 0): HF resumed from its
  final checkpoint would train one step past `max_steps`.
* HF's own save or evaluation after a step or an epoch is declared a pause
  (`TrainingHooks.begin_pause`) until the next step: a rank that waits in a barrier for a slow save
  is no hang.
* each save (`on_save`): seals `checkpoint-N` once every rank wrote its part, then, for an agreed
  stop, exits 75 for `gpuwatch launch` to relaunch.
* a peer's death: HF has no exception hook, so the rescue runs from `sys.excepthook` (and at the
  step's end after torchrun's SIGTERM): a survivor writes `checkpoint-N` of the last completed step
  in HF's own layout (model, optimizer, scheduler, trainer state), sealed, alone, and exits 75.
  Not with FSDP or DeepSpeed: no rank holds the whole state (the job resumes from HF's last save).
* `GpuwatchCallback(snapshot_every=K)`: host snapshots every K steps (gpuwatch.frameworks.hf_snapshot);
  at a resume the newest one newer than the newest verified `checkpoint-N` becomes `checkpoint-<step>`.
  Not with FSDP or DeepSpeed (HF's sharded layout is not written from a snapshot).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gpuwatch.frameworks.hf_snapshot import HfSnapshots, trainer_state_json, write_hf_checkpoint
from gpuwatch.frameworks.in_place import refuse_in_place
from gpuwatch.trainer.hooks import TrainingHooks, _initialized_dist
from gpuwatch.trainer.link import TrainerLink
from gpuwatch.trainer.sealed import seal, set_aside_unverified

log = logging.getLogger("gpuwatch.frameworks")

CHECKPOINT_PATTERN = r"checkpoint-(\d+)"
INCOMPLETE_MARKERS = ("checkpoint-is-incomplete.txt",)  # HF's JIT checkpoint leaves it until its save is done


class GpuwatchCallback(TrainerCallback):
    """gpuwatch's stop, rescue and verified resume for a Hugging Face Trainer.

    Args:
        link: the rank's TrainerLink; default: a new one, made here (on the main thread).
        snapshot_every: take a host snapshot every this many steps, and resume from the newest one
            when it is newer than the newest verified checkpoint; None: no snapshots.
        snapshot_root: where snapshots live; default $GPUWATCH_SNAPSHOT_ROOT, else /dev/shm.
    """

    def __init__(
        self, link: TrainerLink | None = None, *, snapshot_every: int | None = None, snapshot_root: str | None = None
    ) -> None:
        self.hooks = TrainingHooks(link, save=self._rescue_save)
        self.snapshots = (
            None
            if snapshot_every is None
            else HfSnapshots(snapshot_every, CHECKPOINT_PATTERN, INCOMPLETE_MARKERS, snapshot_root)
        )
        self.set_aside: list[tuple[str, str]] = []
        self._args: TrainingArguments | None = None
        self._state: TrainerState | None = None
        self._objects: dict[str, Any] = {}
        self._loss: float | None = None

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        refuse_in_place("Hugging Face Trainer")
        self._args = args
        if _shards_state(args):
            self.hooks.save = None
            if self.snapshots is not None:
                log.warning(
                    "gpuwatch: no host snapshots with FSDP or DeepSpeed: HF's sharded layout is not written from one"
                )
                self.snapshots = None
        _output_dir(args).mkdir(parents=True, exist_ok=True)
        self.set_aside = set_aside_unverified(_output_dir(args), CHECKPOINT_PATTERN, INCOMPLETE_MARKERS)
        if self.snapshots is not None and kw.get("model") is not None:
            self.snapshots.restore_into(_output_dir(args), kw["model"])
            dist = _initialized_dist()
            if dist is not None:
                dist.barrier()  # the restored checkpoint-N is there before any rank looks

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._args, self._state = args, state
        self._objects = {name: kw.get(name) for name in ("model", "optimizer", "lr_scheduler")}
        self.hooks.install_excepthook()
        if self.snapshots is not None:
            self.snapshots.start(self._objects, state)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.hooks.begin_step()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: Any = None, **kw: Any
    ) -> None:
        loss = (logs or {}).get("loss")
        if isinstance(loss, (int, float)):
            self._loss = float(loss)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.snapshots is not None:
            self.snapshots.step(state.global_step)
        if self.hooks.end_step(state.global_step, self._loss):
            if 0 < state.max_steps <= state.global_step:
                self.hooks.finish_instead()  # HF resumed at max_steps trains a step past it: end here, exit 0
            else:
                control.should_save = True
                control.should_training_stop = True
        self._pause_for_hf(control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._pause_for_hf(control)  # an epoch strategy's save or evaluation

    def _pause_for_hf(self, control: TrainerControl) -> None:
        """HF saves or evaluates next (its own flags, set before our callback runs): a declared pause."""
        if control.should_save or control.should_evaluate:
            self.hooks.begin_pause("checkpoint" if control.should_save else "evaluation")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        dist = _initialized_dist()
        if dist is not None:
            dist.barrier()  # every rank's part (its RNG state) is written
        path = _output_dir(args) / f"checkpoint-{state.global_step}"
        if args.should_save and path.is_dir():
            seal(path, state.global_step)
        if self.hooks.stopping:
            if dist is not None:
                dist.barrier()  # sealed before any rank leaves
            if self.snapshots is not None:
                self.snapshots.close(finished=False)
            self.hooks.exit_for_resume()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.snapshots is not None:
            self.snapshots.close(finished=True)
        self.hooks.close()

    def _rescue_save(self, step: int) -> None:
        """A survivor's save of `step` in HF's own layout, alone: `checkpoint-N`, sealed, committed by rename."""
        if self._args is None or self._state is None or self._state.global_step != step:
            held = None if self._state is None else self._state.global_step
            log.error("gpuwatch: no rescue: the trainer holds step %s, not the last completed step %d", held, step)
            return
        model, optimizer, scheduler = (self._objects.get(k) for k in ("model", "optimizer", "lr_scheduler"))
        if model is None:
            log.error("gpuwatch: no rescue: the trainer gave no model")
            return
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        write_hf_checkpoint(_output_dir(self._args), step, model, state, trainer_state_json(self._state))
        log.warning("gpuwatch: rescued checkpoint-%d", step)


def _output_dir(args: TrainingArguments) -> Path:
    return Path(str(args.output_dir))


def _shards_state(args: TrainingArguments) -> bool:
    """FSDP or DeepSpeed: no rank holds the whole model and optimizer, so no survivor can save them."""
    return bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))
