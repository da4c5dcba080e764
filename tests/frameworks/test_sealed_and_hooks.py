"""Sealed framework checkpoints and the hook-shaped trainer API, in one process (no framework, no daemon)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.trainer.hooks import FRAMEWORK_PAUSE_S, TrainingHooks
from gpuwatch.trainer.link import TrainerLink
from gpuwatch.trainer.sealed import (
    commit_sealed,
    seal,
    set_aside_unverified,
    why_unverified,
    why_unverified_file,
)

PATTERN = r"checkpoint-(\d+)"


def _checkpoint(directory: Path, step: int, *, sealed: bool = True) -> Path:
    path = directory / f"checkpoint-{step}"
    (path / "sub").mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(100_000))
    (path / "sub" / "optimizer.pt").write_bytes(os.urandom(50_000))
    if sealed:
        seal(path, step)
    return path


def test_a_sealed_directory_verifies_and_any_change_says_why(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 10)
    assert why_unverified(path) is None

    model = path / "model.safetensors"
    model.write_bytes(model.read_bytes()[:50_000])
    assert why_unverified(path) == "size mismatch for model.safetensors (manifest 100000, file 50000)"
    assert "not sealed" in str(why_unverified(_checkpoint(tmp_path, 20, sealed=False)))


def test_a_frameworks_incomplete_marker_counts_as_not_verified(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 10)
    (path / "checkpoint-is-incomplete.txt").write_text("in progress")
    assert why_unverified(path, ["checkpoint-is-incomplete.txt"]) == (
        "checkpoint-is-incomplete.txt is there: its writer did not finish"
    )


def test_set_aside_moves_the_newer_unverified_ones_out_of_sight_and_keeps_the_older(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 10, sealed=False)  # older and unverified: the framework never picks it
    _checkpoint(tmp_path, 20)
    torn = _checkpoint(tmp_path, 30)
    (torn / "sub" / "optimizer.pt").unlink()
    _checkpoint(tmp_path, 40, sealed=False)

    skipped = set_aside_unverified(tmp_path, PATTERN)

    assert [name for name, _ in skipped] == ["checkpoint-40", "checkpoint-30"]
    assert skipped[1][1] == "missing sub/optimizer.pt"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    assert len(list(tmp_path.glob(".unverified-checkpoint-*"))) == 2
    assert set_aside_unverified(tmp_path, PATTERN) == []  # nothing left to move


def test_a_survivors_commit_keeps_a_verified_checkpoint_already_in_place(tmp_path: Path) -> None:
    first = _checkpoint(tmp_path, 10)
    before = (first / "model.safetensors").read_bytes()
    temp = tmp_path / ".tmp-checkpoint-10-1"
    temp.mkdir()
    (temp / "model.safetensors").write_bytes(b"another survivor's bytes")

    assert commit_sealed(temp, first, 10) == first
    assert (first / "model.safetensors").read_bytes() == before and not temp.exists()


def test_a_survivors_commit_replaces_a_torn_one(tmp_path: Path) -> None:
    first = _checkpoint(tmp_path, 10)
    (first / "model.safetensors").write_bytes(b"cut")
    temp = tmp_path / ".tmp-checkpoint-10-1"
    temp.mkdir()
    (temp / "model.safetensors").write_bytes(b"whole")

    commit_sealed(temp, first, 10)
    assert (first / "model.safetensors").read_bytes() == b"whole" and why_unverified(first) is None


def test_a_one_file_checkpoint_is_sealed_beside_it(tmp_path: Path) -> None:
    from gpuwatch.trainer.sealed import seal_file

    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(os.urandom(40_000))
    assert "not sealed" in str(why_unverified_file(ckpt))
    seal_file(ckpt, 7)
    assert why_unverified_file(ckpt) is None
    ckpt.write_bytes(os.urandom(40_000))
    assert str(why_unverified_file(ckpt)).startswith("crc32 mismatch for last.ckpt")


@pytest.fixture
def link(tmp_path: Path) -> Iterator[TrainerLink]:
    previous = signal.getsignal(signal.SIGTERM)
    yield TrainerLink(tmp_path, report_interval_s=3600.0, gpu_uuid="GPU-test")
    signal.signal(signal.SIGTERM, previous)  # a rescue leaves SIGTERM waiting: its process is about to exit


def test_one_process_stops_at_the_step_it_was_asked_and_only_then(link: TrainerLink) -> None:
    hooks = TrainingHooks(link)
    hooks.begin_step()
    assert hooks.end_step(1, 2.5) is False and link.last_step == 1 and link.last_loss == 2.5
    link.request_stop("test")
    hooks.begin_step()
    assert hooks.end_step(2) is True and hooks.stopping
    hooks.close()


def test_a_frameworks_save_is_a_declared_pause_until_the_next_step_begins(link: TrainerLink) -> None:
    hooks = TrainingHooks(link)
    hooks.begin_step()
    hooks.end_step(1)
    before = time.time()
    hooks.begin_pause("checkpoint")
    hooks.begin_pause("evaluation")  # one pause at a time: the save's goes on
    report = link.report()
    assert (
        report["pause"] == "checkpoint"
        and before + FRAMEWORK_PAUSE_S <= report["pause_until"] <= time.time() + FRAMEWORK_PAUSE_S
    )
    hooks.begin_step()  # the pause ends as the next step begins, dated then
    report = link.report()
    assert report["pause"] is None and before <= report["pause_until"] <= time.time()
    hooks.begin_pause("checkpoint", up_to_s=60.0)
    hooks.close()
    assert link.report()["pause"] is None


def test_a_peers_collective_error_saves_the_last_step_alone_and_exits_75(link: TrainerLink) -> None:
    saved: list[int] = []
    hooks = TrainingHooks(link, save=saved.append)
    hooks.begin_step()
    hooks.end_step(7)
    hooks.begin_step()
    with pytest.raises(SystemExit) as done:
        hooks.failure(RuntimeError("[gloo] Connection closed by peer"))
    assert (done.value.code, saved) == (75, [7])


def test_a_rank_s_own_error_is_not_rescued(link: TrainerLink) -> None:
    saved: list[int] = []
    hooks = TrainingHooks(link, save=saved.append)
    hooks.end_step(3)
    hooks.failure(ValueError("bad batch"))
    hooks.failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert saved == []
    hooks.close()


def test_after_torchruns_sigterm_the_finished_step_is_rescued_not_killed(link: TrainerLink) -> None:
    saved: list[int] = []
    hooks = TrainingHooks(link, save=saved.append)
    hooks.begin_step()
    hooks.end_step(4)
    hooks.begin_step()
    link._on_signal(signal.SIGTERM, None)  # what the handler does when the signal arrives (default action before)
    with pytest.raises(SystemExit) as done:
        hooks.end_step(5)
    assert (done.value.code, saved) == (75, [5])


def test_torchruns_sigterm_during_the_rescue_save_waits_instead_of_running_the_frameworks_handler(
    tmp_path: Path,
) -> None:
    def lightnings(_signum: int, _frame: object) -> None:  # Lightning broadcasts in its SIGTERM handler
        raise RuntimeError("[gloo] Connection reset by peer")

    previous = signal.signal(signal.SIGTERM, lightnings)
    try:
        link = TrainerLink(tmp_path, report_interval_s=3600.0, gpu_uuid="GPU-test")  # chains to it
        saved: list[int] = []

        def save(step: int) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # torchrun tears the group down mid-save
            for _ in range(1000):  # bytecode for the handler to run between
                pass
            saved.append(step)

        hooks = TrainingHooks(link, save=save)
        hooks.end_step(9)
        with pytest.raises(SystemExit) as done:
            hooks.failure(RuntimeError("[gloo] Connection closed by peer"))
        assert (done.value.code, saved) == (75, [9])
    finally:
        signal.signal(signal.SIGTERM, previous)
