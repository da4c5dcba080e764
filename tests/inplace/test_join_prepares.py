"""What a joining rank makes before its group forms: a standby pins the restore's host buffers while it waits (only
in a process whose set-up made a CUDA context), and a rank holding no state reads its newest host snapshot onto the GPU
while the group forms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuwatch.inplace import engine, sharded
from gpuwatch.trainer import standby


def test_a_standby_of_a_sharded_job_pins_the_restore_buffers_before_it_waits_only_with_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Registered as the job side is imported, so it runs wherever the standby waits (a RANK read before the job)."""
    assert sharded._pin_if_cuda in standby._prepares
    pinned: list[bool] = []
    monkeypatch.setattr(sharded, "pin_restore_buffers", lambda: pinned.append(True) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    sharded._pin_if_cuda()
    assert pinned == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    sharded._pin_if_cuda()
    assert pinned == [True]


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("device", "factory", "reads_ahead"),
    [("cuda:0", False, True), ("cpu", False, False), ("cuda:0", True, False)],
    ids=["on-a-gpu", "on-the-cpu-the-slot-is-mapped", "zero-optimizer-made-in-sync"],
)
def test_a_rank_holding_no_state_reads_its_newest_snapshot_while_its_group_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, factory: bool, reads_ahead: bool
) -> None:
    """The read ahead is of this rank's place in a job of `places` ranks: the slots the restore will list."""
    from gpuwatch.snapshots import ROOT_ENV

    monkeypatch.setenv("GPUWATCH_JOB_ID", "before-group")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    reads: list[tuple[int, int, str]] = []
    monkeypatch.setattr(
        sharded.HostSnapshot, "prefetch", lambda self, d: reads.append((self.rank, self.world_size, str(d)))
    )
    model, optimizer = _model_and_optimizer()
    source = sharded.SnapshotRollback(model, (lambda: optimizer) if factory else optimizer, every=2)
    source.before_group(engine.Group(1, 2, 3, None, torch.device(device)))
    try:
        assert reads == ([(1, 3, "cuda:0")] if reads_ahead else [])
        assert (source.snapshot is not None) == (device == "cuda:0" and not factory)
    finally:
        source.close(finished=True)
