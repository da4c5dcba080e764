"""A Lightning job as a user writes it, with gpuwatch's one line (and Lightning's own `ckpt_path="last"`).

A tiny GPT-2 built from its config on the CPU (DDP over gloo under torchrun), random tokens.
Besides the documented line it has only the test's instruments: `StepLog` writes each finished
step to the job's own log (`--log`, one file per rank: "step PID N", "loss PID N LOSS"), and slows
the steps (`--step-sleep`) so a test can strike at a step.

    gpuwatch launch -- tests/frameworks/lightning_train.py --out DIR --log LOG [--steps N] [--save-steps N]
"""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from gpuwatch.frameworks.lightning import GpuwatchLightning
from tests.frameworks.tiny import job_options, tiny_gpt2


class TinyGPT(pl.LightningModule):
    def __init__(self, save_sleep_s: float = 0.0) -> None:
        super().__init__()
        self.model = tiny_gpt2()
        self.save_sleep_s = save_sleep_s

    def on_save_checkpoint(self, checkpoint: dict[str, object]) -> None:
        if self.trainer.global_rank == 0:  # a slow save on rank 0: the other ranks wait for it in a barrier
            time.sleep(self.save_sleep_s)

    def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=batch, labels=batch).loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepLog(pl.Callback):  # type: ignore[misc]
    """The job's own step log, flushed line by line; and a sleep per step."""

    def __init__(self, path: str, sleep_s: float) -> None:
        self.file = open(f"{path}.rank{os.environ.get('RANK', '0')}", "a")  # noqa: SIM115
        self.sleep_s = sleep_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):  # type: ignore[no-untyped-def]
        pid, step = os.getpid(), trainer.global_step
        self.file.write(f"step {pid} {step}\nloss {pid} {step} {float(outputs['loss'])}\n")
        self.file.flush()
        time.sleep(self.sleep_s)


def main() -> None:
    options = job_options()

    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4096, 32), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(list(tokens), batch_size=4)
    checkpoints = ModelCheckpoint(
        dirpath=options.out, every_n_train_steps=options.save_steps, save_top_k=-1, save_last=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=options.steps,
        callbacks=[StepLog(options.log, options.step_sleep), checkpoints, GpuwatchLightning()],  # the one line
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyGPT(options.save_sleep), data, ckpt_path="last")


if __name__ == "__main__":
    main()
