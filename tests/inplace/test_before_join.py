"""A standby makes what its first sync needs while it waits: the engine asks its state source before the join, and
a snapshot source pins the restore's buffers there only in a process that already has a CUDA context."""

from __future__ import annotations

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
