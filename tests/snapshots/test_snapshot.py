"""HostSnapshot in one process on the CPU: what a snapshot holds, what a restore returns, when slots go.

A "relaunch" here is a second HostSnapshot of the same job id reading the same directory, as a new
process would; the tests with real deaths (SIGKILL) are in test_deaths.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuwatch.snapshots import HostSnapshot, choose_every, restore
from gpuwatch.snapshots.cadence import parse_every
from gpuwatch.snapshots.restore import candidates, read_to_device
from gpuwatch.snapshots.slot import HEADER_LEN
from gpuwatch.trainer.checkpoint import load_latest, save_checkpoint

JOB = "job-under-test"


def _trainer(seed: int = 0, width: int = 16, batchnorm: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, width)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(width))
    layers += [torch.nn.ReLU(), torch.nn.Linear(width, 1)]
    net = torch.nn.Sequential(*layers)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def _train_step(net: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    net(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _snapshot(root: Path, net: torch.nn.Module, optim: torch.optim.Optimizer, **kwargs: Any) -> HostSnapshot:
    kwargs.setdefault("every", 2)
    root.mkdir(parents=True, exist_ok=True)  # /dev/shm is always there
    return HostSnapshot(lambda: _state(net, optim), optimizer=optim, job_id=JOB, root=str(root), **kwargs)


def _state(net: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": net.state_dict(), "optim": optim.state_dict(), "note": "mlp"}


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_clone(v) for v in state)
    return state


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _run(snap: HostSnapshot, net: torch.nn.Module, optim: torch.optim.Optimizer, steps: range,
         on_step: Callable[[int], None] | None = None) -> None:  # fmt: skip
    for step in steps:
        _train_step(net, optim, step)
        snap.step(step)
        if on_step is not None:
            on_step(step)


def _job_dir(root: Path) -> Path:
    return root / f"gpuwatch-{os.getuid()}" / f"job-{JOB}"


def test_a_relaunch_restores_the_newest_snapshot_exactly(tmp_path: Path) -> None:
    net, optim = _trainer()
    expected: dict[int, Any] = {}
    snap = _snapshot(tmp_path, net, optim, every=3)
    _run(snap, net, optim, range(1, 12), lambda step: expected.__setitem__(step, _clone(_state(net, optim))))
    snap.close(remove=False)  # as a rank that stops for resume

    again = _snapshot(tmp_path, *_trainer(seed=1), every=3)
    restored = again.restore()
    again.close(remove=False)

    assert restored is not None and (restored.step, restored.source) == (9, "memory")
    assert restored.where.startswith(str(_job_dir(tmp_path)))
    _assert_same(restored.state, expected[9])
    modes = {p.name: p.stat().st_mode & 0o777 for p in _job_dir(tmp_path).iterdir()}
    assert modes == {"rank-00000.slot0": 0o600, "rank-00000.slot1": 0o600}
    assert _job_dir(tmp_path).stat().st_mode & 0o777 == 0o700
    assert _job_dir(tmp_path).parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.slow
def test_the_copy_holds_the_boundarys_state_while_the_next_update_waits(tmp_path: Path) -> None:
    """The next optimizer step runs right after the boundary: its in-place update must not reach the snapshot.

    Large enough (96 MiB of state) that the background copy is still running when the update comes; the
    batch-norm buffers, which the forward changes in place and the optimizer does not own, are cloned.
    """
    net, optim = _trainer(width=1 << 20, batchnorm=True)
    snap = _snapshot(tmp_path, net, optim, every=5)
    boundary: dict[str, Any] = {}

    def after(step: int) -> None:
        if step == 5:
            boundary.update(_clone(_state(net, optim)))

    _run(snap, net, optim, range(1, 7), after)  # step 6 updates everything right after the boundary of 5
    assert not torch.equal(net[0].weight, boundary["model"]["0.weight"])
    snap.close(remove=False)

    restored = _snapshot(tmp_path, *_trainer(width=1 << 20, batchnorm=True), every=5).restore()
    assert restored is not None and restored.step == 5
    _assert_same(restored.state, boundary)


def test_a_torn_newest_slot_falls_back_to_the_other(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    net, optim = _trainer()
    snap = _snapshot(tmp_path, net, optim, every=2)
    _run(snap, net, optim, range(1, 7))  # snapshots of 2, 4, 6
    snap.close(remove=False)
    newest = max(_job_dir(tmp_path).iterdir(), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(newest.read_bytes())
    data[HEADER_LEN + 8192 + 3] ^= 0xFF  # one bit of the tensor bytes, after the commit
    newest.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="gpuwatch.snapshots"):
        restored = _snapshot(tmp_path, *_trainer(), every=2).restore()

    assert restored is not None and restored.step == 4
    assert f"host snapshot {newest.name} (step 6) not used: crc32 mismatch" in caplog.text


def test_a_restore_from_an_older_disk_checkpoint_retires_newer_slots(tmp_path: Path) -> None:
    net, optim = _trainer()
    snap = _snapshot(tmp_path, net, optim, every=2)
    _run(snap, net, optim, range(1, 10))  # slots at 6 and 8
    snap.close(remove=False)

    later = _snapshot(tmp_path, net, optim, every=2)
    later.resumed_from(3)  # the job chose the disk's step 3: 6 and 8 belong to an abandoned run
    _run(later, net, optim, range(4, 6))  # every 2 from 3: one new snapshot, of 5, in the older slot
    later.close(remove=False)

    restored = _snapshot(tmp_path, *_trainer(), every=2).restore()
    assert restored is not None and restored.step == 5  # not the abandoned run's 8


def test_resume_prefers_memory_and_falls_back_to_the_disk(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    net, optim = _trainer()
    snap = _snapshot(tmp_path / "shm", net, optim, every=2)
    _run(snap, net, optim, range(1, 6))  # snapshot of 4
    save_checkpoint(ckpt, 3, _state(net, optim))
    snap.close(remove=False)

    from_memory = _snapshot(tmp_path / "shm", *_trainer()).resume(ckpt)
    assert from_memory is not None and (from_memory.step, from_memory.source) == (4, "memory")

    save_checkpoint(ckpt, 5, _state(net, optim))  # the disk is newer now: the snapshot of 4 is not the one
    from_disk = _snapshot(tmp_path / "shm", *_trainer()).resume(ckpt)
    assert from_disk is not None and (from_disk.step, from_disk.source) == (5, "disk")


def test_slots_are_removed_when_the_job_finishes_and_kept_when_it_stops_for_resume(tmp_path: Path) -> None:
    net, optim = _trainer()
    with pytest.raises(SystemExit), _snapshot(tmp_path, net, optim) as snap:
        _run(snap, net, optim, range(1, 6))  # snapshots of 2 and 4
        raise SystemExit(75)  # TrainerLink.exit_for_resume
    assert sorted(p.name for p in _job_dir(tmp_path).iterdir()) == ["rank-00000.slot0", "rank-00000.slot1"]

    with _snapshot(tmp_path, net, optim) as snap:
        _run(snap, net, optim, range(4, 8))
    assert not _job_dir(tmp_path).exists()
    assert list(_job_dir(tmp_path).parent.iterdir()) == []


def test_checkpoint_and_rescue_are_written_from_host_memory(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    net, optim = _trainer()
    snap = _snapshot(tmp_path / "shm", net, optim, every=2, replicated=True)
    _run(snap, net, optim, range(1, 5))
    snap.checkpoint(ckpt, 4, wait=True)
    at_4 = _clone(_state(net, optim))
    _run(snap, net, optim, range(5, 8))  # 6 is in a slot, 7 is not: the rescue copies 7 first
    path = snap.rescue(ckpt, 7)
    at_7 = _clone(_state(net, optim))
    snap.close(remove=False)

    assert path == ckpt / "step-00000007"
    loaded = load_latest(ckpt)
    assert loaded is not None and loaded.step == 7
    _assert_same(loaded.state, at_7)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000004", "step-00000007"]
    assert load_latest(ckpt) is not None
    restored = _snapshot(tmp_path / "shm", *_trainer(), replicated=True).restore()
    assert restored is not None and restored.step == 7  # the rescue committed it in memory first
    del at_4


def test_a_snapshot_directory_taken_by_another_user_or_a_symlink_is_not_used_and_snapshots_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make a directory another uid owns")
    root = tmp_path / "shm"
    trap = root / f"gpuwatch-{os.getuid()}"
    trap.mkdir(parents=True)
    os.chown(trap, 54321, 54321)  # another local user made it first
    net, optim = _trainer()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.snapshots"):
        snap = _snapshot(root, net, optim)
    assert snap.enabled
    assert f"{trap} belongs to uid 54321, not to this job's uid 0: not used" in caplog.text
    _run(snap, net, optim, range(1, 4))
    snap.close(remove=False)
    assert list(trap.iterdir()) == []
    (fallback,) = [p for p in root.iterdir() if p != trap]
    assert fallback.name.startswith(f"gpuwatch-{os.getuid()}-") and fallback.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in (fallback / f"job-{JOB}").iterdir()) == ["rank-00000.slot0", "rank-00000.slot1"]

    again = _snapshot(root, *_trainer(seed=1))  # a relaunch finds the fallback again
    restored = again.restore()
    again.close(remove=True)
    assert restored is not None and (restored.step, restored.source) == (2, "memory")
    assert not (fallback / f"job-{JOB}").exists()  # a finished job removes its slots there too

    trap.rmdir()
    fallback.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    trap.symlink_to(elsewhere)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.snapshots"):
        linked = _snapshot(root, net, optim)
    assert linked.enabled
    linked.close(remove=True)
    assert "is not a directory (a symlink or a file): not used" in caplog.text
    assert list(elsewhere.iterdir()) == []


def test_auto_cadence_measures_the_first_snapshot(tmp_path: Path) -> None:
    net, optim = _trainer(width=1 << 18)
    snap = _snapshot(tmp_path, net, optim, every="auto")
    assert snap.every is None
    _run(snap, net, optim, range(1, 3))
    assert snap.snapshots == 0  # three step intervals first: the step time the cost is judged against
    _run(snap, net, optim, range(3, 8))
    snap.close(remove=True)
    assert snap.snapshots >= 1 and snap.auto_basis is not None
    cost_s, step_s = snap.auto_basis  # from the loop's own step intervals (test_cost.py checks the claim)
    assert cost_s >= 0 and step_s > 0
    assert snap.every == choose_every(cost_s, step_s, background_s=snap.stats()["drain_s"])


def test_choose_every_keeps_the_cost_under_the_share() -> None:
    assert choose_every(0.02, 1.0) == 2  # 2 % of a step, every 2 steps: 1 %
    assert choose_every(0.5, 0.1) == 500
    assert choose_every(0.001, 1.0) == 1
    assert choose_every(0.0, 1.0) == 1
    assert choose_every(100.0, 0.001) == 10_000  # capped
    assert choose_every(0.3, 1.0, share=0.1) == 3
    # A CUDA copy off the step: 0.25 s in the background of a 0.25 s step, no wait of its own. Every step would
    # make each boundary wait out the rest of the last copy; from every other step on, nothing waits.
    assert choose_every(0.0, 0.25, background_s=0.25) == 1
    assert choose_every(0.0, 0.25, background_s=0.4) == 2
    assert choose_every(0.008, 0.25, background_s=0.25) == 4  # 8 ms each: 4 steps keep it under 1 %
    with pytest.raises(ValueError, match="share"):
        choose_every(1.0, 1.0, share=0.0)


@pytest.mark.parametrize("value", ["0", "-1", "often", 0, 2.5, True])
def test_a_bad_cadence_is_one_clear_error(value: Any) -> None:
    with pytest.raises(ValueError, match="snapshot cadence must be a positive integer or 'auto'"):
        parse_every(value)
    assert parse_every("auto") is None and parse_every("7") == 7 and parse_every(3) == 3


def test_training_on_from_a_mapped_restore_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """The restored optimizer state is a copy-on-write mapping of the slot: later snapshots must not touch it."""
    reference_net, reference_optim = _trainer()
    for step in range(1, 13):
        _train_step(reference_net, reference_optim, step)

    net, optim = _trainer()
    snap = _snapshot(tmp_path, net, optim, every=2)
    _run(snap, net, optim, range(1, 7))
    snap.close(remove=False)

    net, optim = _trainer(seed=99)
    again = _snapshot(tmp_path, net, optim, every=2)
    restored = again.restore()
    assert restored is not None and restored.step == 6
    net.load_state_dict(restored.state["model"])
    optim.load_state_dict(restored.state["optim"])  # CPU: its tensors stay views of the slot's mapping
    del restored
    _run(again, net, optim, range(7, 13))  # snapshots of 8, 10, 12: both slots rewritten, the mapped one replaced
    again.close(remove=False)

    _assert_same(_state(net, optim), _state(reference_net, reference_optim))
    final = _snapshot(tmp_path, *_trainer()).restore()
    assert final is not None and final.step == 12
    _assert_same(final.state, _state(reference_net, reference_optim))


@pytest.mark.parametrize("piece", [None, 4096], ids=["pieces-of-16MiB", "many-pieces-a-chunk"])
def test_a_restore_onto_a_device_copies_verified_chunks_and_refuses_a_changed_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int | None
) -> None:
    """restore(device=...) reads each chunk a piece at a time into a buffer, checks it, copies it (here the CPU
    stands in for a GPU); a chunk's crc32 runs over all its pieces, so a changed byte in any piece refuses it."""
    if piece is not None:
        monkeypatch.setattr(restore, "PIECE", piece)
    net, optim = _trainer(width=1 << 16)
    snap = _snapshot(tmp_path, net, optim, every=2)
    _run(snap, net, optim, range(1, 5))
    expected = _clone(_state(net, optim))
    snap.close(remove=False)

    again = _snapshot(tmp_path, *_trainer(seed=3, width=1 << 16), every=2)
    assert again._files.dir_fd is not None
    newest = candidates(again._files.dir_fd, rank=0, world_size=1, replicated=False)[0]
    state, reason = read_to_device(again._files.dir_fd, newest, torch.device("cpu"))
    assert reason is None and newest.header.step == 4
    _assert_same(state, expected)
    assert state["optim"]["state"][0]["step"].dim() == 0  # the optimizer's step counters stay on the CPU

    with (_job_dir(tmp_path) / newest.name).open("r+b") as f:  # a byte of a tensor changes after the commit
        f.seek(HEADER_LEN + newest.header.payload_len - 100)
        f.write(b"\x55")
    state, reason = read_to_device(again._files.dir_fd, newest, torch.device("cpu"))
    again.close(remove=True)
    assert state is None and reason is not None and "crc32 mismatch" in reason
