"""A standby makes what its first sync needs while it waits: the engine asks its state source before the join, and
a snapshot source pins the restore's buffers there only in a process that already has a CUDA context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuwatch.inplace import engine, sharded


class _Joined(Exception):
    """Stands for the hand-over: the test stops the engine where the standby would learn its rank."""


class _Source(engine.StateSource):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def before_join(self) -> None:
        self.events.append("before_join")


@pytest.mark.parametrize("standby", [True, False])
def test_a_standby_asks_its_source_to_prepare_before_it_waits_for_its_rank(
    monkeypatch: pytest.MonkeyPatch, standby: bool
) -> None:
    events: list[str] = []

    def wait_for_rank() -> None:
        events.append("wait_for_rank")
        raise _Joined

    monkeypatch.setattr(engine, "wait_for_rank", wait_for_rank)
    monkeypatch.setattr(engine, "is_standby", lambda: standby)
    with pytest.raises(_Joined):
        engine.StepEngine(_Source(events))
    assert events == (["before_join", "wait_for_rank"] if standby else ["wait_for_rank"])


def test_a_snapshot_source_pins_the_restore_buffers_only_where_the_set_up_made_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A standby without a CUDA context may take a rank of any GPU: pinning would make a context and bind it."""
    pinned: list[bool] = []
    monkeypatch.setattr(sharded, "pin_restore_buffers", lambda: pinned.append(True) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    sharded.SnapshotSource().before_join()
    assert pinned == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    sharded.SnapshotSource().before_join()
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
