"""Lightning's own signal handling keeps working beside gpuwatch's: its SLURM requeue still runs on SIGUSR1.

Lightning sets its SLURM requeue handler (SIGUSR1: save an HPC checkpoint, `scontrol requeue`) only
when no handler is there yet. A TrainerLink opened before `fit()` was one, and turned the requeue
off. GpuwatchLightning opens its link when training starts, after Lightning's handlers: both run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow  # a Lightning fit in a child process

JOB = """
import os, signal, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from gpuwatch.frameworks.lightning import GpuwatchLightning

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        if i == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # what SLURM (or the daemon) sends
        return self.layer(batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

gpuwatch = GpuwatchLightning()
trainer = pl.Trainer(
    accelerator="cpu", devices=1, max_steps=6, default_root_dir=sys.argv[1], logger=False,
    enable_progress_bar=False, enable_checkpointing=False, plugins=[SLURMEnvironment(auto_requeue=True)],
    callbacks=[gpuwatch],
)
trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4))
"""


def test_slurm_requeue_and_gpuwatchs_stop_both_see_sigusr1(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "SLURM_", "TORCHELASTIC_"))}
    env.update(
        PYTHONPATH=str(REPO), GPUWATCH_RUNTIME_DIR=str(tmp_path / "run"), PATH=f"{tmp_path}:{env.get('PATH', '')}",
        SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train",
    )  # fmt: skip
    scontrol = tmp_path / "scontrol"  # records the requeue Lightning asks for
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/requeued\n')
    scontrol.chmod(0o755)

    done = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )

    assert (tmp_path / "requeued").read_text().strip() == "requeue 4242"  # Lightning's handler ran
    assert list(tmp_path.glob("hpc_ckpt_*.ckpt"))  # and saved its HPC checkpoint
    assert done.returncode == 75, done.stderr[-3000:]  # gpuwatch's ran too: stop, save, exit for resume
    assert (tmp_path / "last-gpuwatch.ckpt").is_file() and "rescued" not in done.stderr
