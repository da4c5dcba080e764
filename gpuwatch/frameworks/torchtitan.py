"""torchtitan: one config line, `--module gpuwatch.frameworks.torchtitan`, in front of any of torchtitan's configs.

    gpuwatch launch --nproc-per-node 8 -- -m torchtitan.train \\
        --module gpuwatch.frameworks.torchtitan --config llama3_debugmodel --checkpoint.enable

`--config NAME` is the name of one of torchtitan's own config functions (`llama3_debugmodel`,
`llama3_8b`, `deepseek_v3_16b`, ...: the model module is the name's first word); this module
returns the same config with its trainer class replaced by `GpuwatchTrainer`, torchtitan's
`Trainer` with gpuwatch's hooks (gpuwatch.trainer.hooks):

* each step: reported, and one MAX all-reduce of the stop flag beside the step's own work; when
  every rank agreed to stop, torchtitan's own checkpointer saves that step (`step-N`, DCP), it is
  sealed, and every rank exits 75 for `gpuwatch launch` to relaunch: 0 steps lost.
* every `step-N` torchtitan saves (synchronously) is sealed by rank 0 (gpuwatch.trainer.sealed);
  before torchtitan loads, the newest `step-N` that do not verify are set aside with their reason,
  so its own "highest step-N with a .metadata" lands on a good one.
* a peer's death: the state is sharded (FSDP), so no rank can save it alone: the rank leaves at
  once and the job resumes from its newest checkpoint (steps since then are lost).

Written against torchtitan 0.3.0 (`torchtitan.trainer.Trainer`, `components.checkpointer.dcp`).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from torchtitan.trainer import Trainer

from gpuwatch.frameworks.in_place import refuse_in_place
from gpuwatch.trainer.hooks import TrainingHooks, _initialized_dist
from gpuwatch.trainer.sealed import seal, set_aside_unverified, why_unverified

log = logging.getLogger("gpuwatch.frameworks")

STEP_PATTERN = r"step-(\d+)"


class GpuwatchTrainer(Trainer):
    """torchtitan's Trainer with gpuwatch's stop, sealed DCP checkpoints and verified resume."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's own config; declared here so that `build()` makes a GpuwatchTrainer (its owner)."""

    def __init__(self, config: Any) -> None:
        refuse_in_place("torchtitan")
        super().__init__(config)
        self.gpuwatch = TrainingHooks(save=None)  # sharded state: no survivor holds all of it
        self._gpuwatch_stop = False

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        self.gpuwatch.begin_step()
        try:
            super().train_step(data_iterator)
        except Exception as exc:
            self.gpuwatch.failure(exc)  # a peer's failure: leave now (the error goes on)
            raise
        if self.gpuwatch.end_step(self.step):
            self._gpuwatch_stop = True
            self.checkpointer.interval = self.step  # torchtitan's own save, right after this step, saves it

    def should_continue_training(self) -> bool:
        """After each step's save: seal it; after the agreed stop's save, exit 75."""
        self._seal(self.step)
        if self._gpuwatch_stop:
            self.gpuwatch.exit_for_resume()
        return bool(super().should_continue_training())

    def train(self) -> None:
        folder = getattr(self.checkpointer, "folder", None)
        if getattr(self.checkpointer, "enable", False) and folder:
            set_aside_unverified(folder, STEP_PATTERN)  # every rank, before torchtitan picks its newest step-N
        super().train()
        self.gpuwatch.close()

    def _seal(self, step: int) -> None:
        """Seal `step-N` once torchtitan saved it: rank 0, after every rank's shards are written."""
        checkpointer = self.checkpointer
        mode = getattr(checkpointer, "async_mode", "disabled")
        if not getattr(checkpointer, "enable", False) or getattr(mode, "value", mode) != "disabled":
            return  # an async save is not done here yet: it stays unsealed (and is set aside at a resume)
        path = os.path.join(checkpointer.folder, f"step-{step}")
        if not os.path.isdir(path):
            return
        dist = _initialized_dist()
        if dist is not None:
            dist.barrier()  # every rank's shards are written (every rank sees the same directory)
        if (dist is None or dist.get_rank() == 0) and why_unverified(path) is not None:
            seal(path, step)


def gpuwatch_config(config: Any) -> Any:
    """torchtitan's Trainer.Config `config`, as the config of a GpuwatchTrainer."""
    return GpuwatchTrainer.Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})


def __getattr__(name: str) -> Callable[[], Any]:
    """`--config llama3_debugmodel`: torchtitan's own config function of that name, made a GpuwatchTrainer's."""
    if name.startswith("_"):
        raise AttributeError(name)
    model = name.split("_", 1)[0]
    try:
        registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    except ImportError:
        raise AttributeError(f"no torchtitan model {model!r} for config {name!r}") from None
    original = getattr(registry, name, None)
    if not callable(original):
        raise AttributeError(f"torchtitan.models.{model}.config_registry has no config {name!r}")
    return lambda: gpuwatch_config(original())
