"""Modes by the GPU memory a job has left: staging within the budget, what stats() and the one line say.

The GPU's memory is faked where it must be (this machine has none): `allocate_staging` is given the free
memory and a torch whose `empty` hands out sized placeholders; the rest runs as in a job.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuwatch.snapshots import HostSnapshot, prepare
from gpuwatch.snapshots.layout import open_job_dir
from tests.snapshots.conftest import GIB, free_gib


def test_with_room_the_whole_state_is_staged(fake_gpu: list[int]) -> None:
    staging = prepare.allocate_staging(16 * GIB, 0, free_bytes=free_gib(60))
    assert prepare.mode_of(16 * GIB, staging) == "staged" and fake_gpu == [16 * GIB]


def test_a_nearly_full_gpu_stages_only_what_fits_under_the_headroom(fake_gpu: list[int]) -> None:
    staging = prepare.allocate_staging(16 * GIB, 0, free_bytes=free_gib(6))  # the headroom: 5 % of 80 GiB
    assert prepare.mode_of(16 * GIB, staging) == "partial"
    assert staging.numel() <= 2 * GIB  # 6 GiB free less the 4 GiB headroom


def test_the_budget_caps_the_staging_and_a_full_gpu_drains_directly(fake_gpu: list[int]) -> None:
    capped = prepare.allocate_staging(16 * GIB, 0, budget=GIB, free_bytes=free_gib(60))
    assert capped.numel() == GIB and prepare.mode_of(16 * GIB, capped) == "partial"
    full = prepare.allocate_staging(16 * GIB, 0, free_bytes=free_gib(3))
    assert full is None and prepare.mode_of(16 * GIB, full) == "direct"


def test_a_budget_of_zero_takes_no_gpu_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "allocate_staging", lambda *a, **k: pytest.fail("staging asked for"))
    dir_fd = open_job_dir(str(tmp_path), "budget")
    try:
        prepared = prepare.Preparation(dir_fd, 0, 1 << 20, cuda=0, staging=True, replace=set(), budget=0).join()
    finally:
        os.close(dir_fd)
    assert prepared.error is None and prepared.mode == "direct" and prepared.staging is None
    for slot in prepared.slots.values():
        slot.close()


@pytest.mark.parametrize("budget", [-1, "1G", 1.5, True])
def test_a_bad_budget_is_one_clear_error(tmp_path: Path, budget: Any) -> None:
    with pytest.raises(ValueError, match="gpu_budget must be a number of bytes"):
        HostSnapshot(dict, job_id="budget", root=str(tmp_path), gpu_budget=budget)


def test_stats_and_one_line_say_the_mode_its_gpu_memory_and_the_loss_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    params = [torch.zeros(1 << 18)]
    snap = HostSnapshot(lambda: {"params": params}, every=4, job_id="modes", root=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="gpuwatch.snapshots"):
        for step in range(1, 41):
            time.sleep(0.005)
            params[0][step] = step
            snap.step(step)
        snap.wait()
    stats = snap.stats()
    snap.close(remove=True)
    assert stats["mode"] == "cpu" and stats["gpu_bytes"] == 0 and stats["snapshots"] >= 3, stats
    drain_steps = -(-stats["drain_s"] // stats["step_s"])
    assert stats["loss_bound_steps"] == max(4, drain_steps) + drain_steps, stats
    line = next(r.getMessage() for r in caplog.records if "loses at most" in r.getMessage())
    assert "mode cpu, 0.0 MiB of GPU memory, every 4 step(s)" in line, line
