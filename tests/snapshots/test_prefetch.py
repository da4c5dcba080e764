"""The read ahead of a joining rank's restore (gpuwatch.snapshots.prefetch): the restore takes it only for the commit it
holds, drops it for any other before reading that one, and a snapshot that closes first lets it go. The CPU stands
in for the GPU: the read is restore.read_to_device's either way, and recall takes a prefetch only for a CUDA device,
so a device that names itself cuda stands in there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuwatch.snapshots import prefetch, recall
from gpuwatch.snapshots.prefetch import Prefetch
from gpuwatch.snapshots.restore import candidates, read_to_device
from tests.snapshots.test_snapshot import _assert_same, _clone, _run, _snapshot, _state, _trainer


class _NamedCuda:
    """A device that says it is CUDA: recall then reads with read_to_device (here onto the CPU)."""

    type = "cuda"

    def __str__(self) -> str:
        return "cuda:0"


@pytest.fixture
def two_commits(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """Slots of steps 2 and 4 of a small job; the state at step 4 and a HostSnapshot reading them (closed after)."""
    net, optim = _trainer(width=1 << 12)
    snap = _snapshot(tmp_path, net, optim, every=2)
    _run(snap, net, optim, range(1, 5))
    expected = _clone(_state(net, optim))
    snap.close(remove=False)
    again = _snapshot(tmp_path, *_trainer(seed=3, width=1 << 12), every=2)
    yield expected, again
    again.close(remove=True)


def _ahead(snap: Any) -> Prefetch:
    """A read ahead of rank 0's newest commit in the job directory `snap` holds, onto the CPU."""
    assert snap._files.dir_fd is not None
    return Prefetch(snap._files.dir_fd, rank=0, world_size=1, replicated=False, device=torch.device("cpu"))


def _listed(snap: Any) -> list[Any]:
    """Rank 0's committed slots in the job directory `snap` holds, newest first."""
    assert snap._files.dir_fd is not None
    return candidates(snap._files.dir_fd, rank=0, world_size=1, replicated=False)


def _recall(snap: Any, ahead: Prefetch) -> Any:
    assert snap._files.dir_fd is not None
    return recall.recall(snap._files.dir_fd, snap.directory, rank=0, world_size=1, replicated=False, at_least=None,
                         device=_NamedCuda(), prefetched=ahead)  # fmt: skip


def test_the_restore_takes_the_read_ahead_of_the_newest_commit_and_reads_nothing_again(
    two_commits: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected, again = two_commits
    ahead = _ahead(again)
    read_again: list[str] = []
    monkeypatch.setattr(recall, "read_to_device", lambda fd, c, d: read_again.append(c.name) or (None, "read again"))
    found = _recall(again, ahead)
    assert found is not None and found.step == 4 and read_again == []
    _assert_same(found.state, expected)
    newest = _listed(again)[0]
    assert ahead.take(newest) is None  # taken once: it holds nothing after


def test_a_read_ahead_of_another_commit_is_dropped_before_the_one_asked_for_is_read(
    two_commits: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore asks for step 2 only (the other ranks hold no step 4): the read of step 4 goes, then step 2's."""
    _, again = two_commits
    ahead = _ahead(again)
    order: list[str] = []
    real_take = ahead.take
    monkeypatch.setattr(ahead, "take", lambda c: order.append(f"take {c.header.step}") or real_take(c))

    def read(fd: int, candidate: Any, device: Any) -> tuple[Any, str | None]:
        order.append(f"read {candidate.header.step} (ahead holds {ahead._result is not None})")
        return read_to_device(fd, candidate, torch.device("cpu"))

    monkeypatch.setattr(recall, "read_to_device", read)
    monkeypatch.setattr(recall, "common_steps", lambda by_step: [2])
    found = _recall(again, ahead)
    assert found is not None and found.step == 2
    assert order == ["take 2", "read 2 (ahead holds False)"]
    assert ahead.candidate is not None and ahead.candidate.header.step == 4


def test_a_slot_committed_again_after_the_read_ahead_is_read_afresh(tmp_path: Path) -> None:
    """The read ahead holds the slot file of step 4; that same file then holds step 8: the restore must not take the
    read of step 4 for it (the commit is the file, its seq and its step)."""
    net, optim = _trainer(width=1 << 12)
    snap = _snapshot(tmp_path, net, optim, every=2)
    _run(snap, net, optim, range(1, 5))
    snap.wait()
    ahead = _ahead(snap)
    _run(snap, net, optim, range(5, 9))  # steps 6 and 8: the slot of step 4 now holds step 8
    snap.wait()
    now = _listed(snap)
    try:
        assert ahead.candidate is not None and ahead.candidate.header.step == 4
        assert [c.header.step for c in now] == [8, 6] and now[0].name == ahead.candidate.name
        assert ahead.take(now[0]) is None
    finally:
        snap.close(remove=True)


def test_a_snapshot_closed_with_a_read_ahead_under_way_waits_for_it_and_lets_it_go(
    two_commits: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read uses the job directory's fd, which close() closes: the read is waited for first."""
    _, again = two_commits
    finished: list[bool] = []
    real = prefetch.read_to_device

    def slow(fd: int, candidate: Any, device: Any) -> tuple[Any, str | None]:
        import time

        time.sleep(0.3)
        out = real(fd, candidate, torch.device("cpu"))
        finished.append(out[0] is not None)
        return out

    monkeypatch.setattr(prefetch, "read_to_device", slow)
    again.prefetch("cuda:0")  # a CUDA device's name: the read ahead starts (onto the CPU here)
    assert again._prefetch is not None
    again.close(remove=True)
    assert finished == [True] and again._prefetch is None


def test_a_cpu_restore_reads_nothing_ahead(two_commits: tuple[Any, Any]) -> None:
    """On the CPU a rank's own slot is mapped, not copied: nothing to read ahead."""
    _, again = two_commits
    again.prefetch(torch.device("cpu"))
    assert again._prefetch is None


def test_a_job_directory_that_cannot_be_listed_leaves_nothing_read_ahead_and_the_join_goes_on(
    two_commits: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read ahead only saves time: a listing that fails (the daemon out of descriptors) must not fail the join."""
    _, again = two_commits

    def refuse(*_: Any, **__: Any) -> list[Any]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(prefetch, "candidates", refuse)
    again.prefetch("cuda:0")
    assert again._prefetch is not None and again._prefetch.candidate is None
    newest = _listed(again)[0]
    assert again._prefetch.take(newest) is None  # the restore reads it itself
