"""Verified checkpoints: round trip, fallback past corrupt / partial / missing ones, pruning, DDP, DCP."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpuwatch.errors import CheckpointError
from gpuwatch.trainer.checkpoint import (
    LATEST,
    MANIFEST,
    commit_checkpoint,
    latest_step,
    load_latest,
    new_temp_dir,
    save_checkpoint,
    verify_checkpoint,
)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((4, 4), float(step)), "step": step, "note": f"at {step}"}


def _save_steps(directory: Path, *steps: int, keep: int = 3) -> None:
    for step in steps:
        save_checkpoint(directory, step, _state(step), keep=keep)


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 7, _state(7))

    assert path == tmp_path / "step-00000007"
    assert (tmp_path / LATEST).read_text() == "step-00000007\n"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 7
    assert manifest["state_file"] == "state.flat"  # a state dict goes to a flat tensor file
    size = (path / "state.flat").stat().st_size
    assert manifest["files"]["state.flat"]["size"] == size
    chunks = manifest["files"]["state.flat"]["crc32"]  # [offset, length, crc] tiling the file
    assert chunks[0][0] == 0 and sum(length for _, length, _ in chunks) == size
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000007"]  # no temp dir left

    loaded = load_latest(tmp_path)
    assert loaded is not None
    assert (loaded.step, loaded.path, loaded.skipped) == (7, path, [])
    assert torch.equal(loaded.state["w"], torch.full((4, 4), 7.0))
    assert loaded.state["note"] == "at 7"
    assert verify_checkpoint(path) is None


def _first_chunk(path: Path) -> int:
    """Where the first chunk of a checkpoint's flat state file ends (its header and structure)."""
    chunks = json.loads((path / MANIFEST).read_text())["files"]["state.flat"]["crc32"]
    return int(chunks[0][1])


def test_without_torch_state_is_pickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as if the program never imported torch
    path = save_checkpoint(tmp_path, 3, {"weights": [1.0, 2.0], "step": 3})

    assert (path / "state.pkl").is_file()
    loaded = load_latest(tmp_path)
    assert loaded is not None
    assert loaded.state == {"weights": [1.0, 2.0], "step": 3}


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "absent") is None


def test_corrupt_newest_is_skipped_with_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save_steps(tmp_path, 20, 40)
    _flip_byte(tmp_path / "step-00000040" / "state.flat")

    with caplog.at_level(logging.WARNING, logger="gpuwatch.trainer"):
        loaded = load_latest(tmp_path)

    assert loaded is not None
    assert loaded.step == 20
    reason = f"crc32 mismatch for state.flat in bytes 0-{_first_chunk(tmp_path / 'step-00000040')}"
    assert loaded.skipped == [("step-00000040", reason)]
    assert f"step-00000040: {reason}" in caplog.text


def test_truncated_file_is_a_size_mismatch(tmp_path: Path) -> None:
    _save_steps(tmp_path, 1, 2)
    state = tmp_path / "step-00000002" / "state.flat"
    size = state.stat().st_size
    os.truncate(state, size // 2)

    loaded = load_latest(tmp_path)

    assert loaded is not None and loaded.step == 1
    assert loaded.skipped == [("step-00000002", f"size mismatch for state.flat (manifest {size}, file {size // 2})")]


def test_partial_checkpoints_are_skipped(tmp_path: Path) -> None:
    _save_steps(tmp_path, 10, 20)
    (tmp_path / "step-00000020" / MANIFEST).unlink()  # renamed without a manifest: not ours to trust
    leftover = tmp_path / ".tmp-step-30-4242"  # a save killed half way
    leftover.mkdir()
    (leftover / "state.pt").write_bytes(b"half")

    loaded = load_latest(tmp_path)

    assert loaded is not None and loaded.step == 10
    assert loaded.skipped == [
        ("step-00000020", "no manifest.json (incomplete save)"),
        (".tmp-step-30-4242", "left behind by an interrupted save"),
    ]


def test_latest_naming_a_missing_directory_falls_back(tmp_path: Path) -> None:
    _save_steps(tmp_path, 5, 6)
    (tmp_path / LATEST).write_text("step-00000099\n")

    loaded = load_latest(tmp_path)

    assert loaded is not None and loaded.step == 6
    assert loaded.skipped == [("step-00000099", "named by latest but not there")]


def test_latest_is_preferred_over_a_newer_directory(tmp_path: Path) -> None:
    _save_steps(tmp_path, 5, 6)
    (tmp_path / LATEST).write_text("step-00000005\n")

    loaded = load_latest(tmp_path)

    assert loaded is not None and (loaded.step, loaded.skipped) == (5, [])


def test_manifest_for_another_step_does_not_verify(tmp_path: Path) -> None:
    _save_steps(tmp_path, 5)
    (tmp_path / "step-00000005").rename(tmp_path / "step-00000009")

    assert verify_checkpoint(tmp_path / "step-00000009") == "manifest.json is for step 5"


def test_nothing_verifies_raises(tmp_path: Path) -> None:
    _save_steps(tmp_path, 1)
    _flip_byte(tmp_path / "step-00000001" / "state.flat")

    with pytest.raises(CheckpointError, match="step-00000001: crc32 mismatch for state.flat"):
        load_latest(tmp_path)


def test_keep_prunes_older_checkpoints_and_leftovers(tmp_path: Path) -> None:
    (tmp_path / ".tmp-step-2-1").mkdir(parents=True)  # stale: an older step's failed save
    (tmp_path / ".tmp-step-99-1").mkdir()  # a later step's save may still be running
    _save_steps(tmp_path, 1, 2, 3, 4, 5, keep=3)

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".tmp-step-99-1", LATEST, "step-00000003", "step-00000004", "step-00000005"]


def test_save_after_resuming_from_an_older_step_drops_the_abandoned_newer_ones(tmp_path: Path) -> None:
    _save_steps(tmp_path, 10, 20, 30)
    save_checkpoint(tmp_path, 15, _state(15))

    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000010", "step-00000015"]
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 15


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 4, {"v": 1})
    save_checkpoint(tmp_path, 4, {"v": 2})

    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.state == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000004"]


def test_failed_save_raises_and_leaves_nothing(tmp_path: Path) -> None:
    barrier_calls: list[int] = []
    with pytest.raises(CheckpointError, match="cannot write checkpoint of step 3"):
        save_checkpoint(tmp_path, 3, {"lock": threading.Lock()}, barrier=lambda: barrier_calls.append(1))

    assert barrier_calls == [1]  # rank 0 still meets the other ranks
    assert list(tmp_path.iterdir()) == []


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, {}, keep=0)


def test_only_rank_zero_writes_and_every_rank_waits(tmp_path: Path) -> None:
    calls: list[str] = []

    def other_rank_barrier() -> None:  # rank 0 "runs" while rank 1 waits at the barrier
        calls.append("rank 1 at barrier")
        save_checkpoint(tmp_path, 8, _state(8), rank=0, barrier=lambda: calls.append("rank 0 at barrier"))

    path = save_checkpoint(tmp_path, 8, object(), rank=1, barrier=other_rank_barrier)

    assert calls == ["rank 1 at barrier", "rank 0 at barrier"]
    assert path == tmp_path / "step-00000008"
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.state["step"] == 8


def test_other_rank_raises_when_rank_zero_wrote_nothing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="rank 0 did not save"):
        save_checkpoint(tmp_path, 8, None, rank=1, barrier=lambda: None)


def test_uses_torch_distributed_when_initialized(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        path = save_checkpoint(tmp_path / "ckpt", 2, _state(2))
    finally:
        dist.destroy_process_group()
    assert verify_checkpoint(path) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_recipe_from_the_module_docstring(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}}
    tmp = new_temp_dir(tmp_path, 12)
    dcp.save(state, checkpoint_id=tmp)
    path = commit_checkpoint(tmp_path, 12, tmp)

    with pytest.raises(CheckpointError, match="a DCP checkpoint"):  # dcp.load unpickles: only when asked
        load_latest(tmp_path)
    loaded = load_latest(tmp_path, allow_code_execution=True)
    assert loaded is not None
    assert (loaded.step, loaded.state, loaded.path) == (12, None, path)
    assert ".metadata" in json.loads((path / MANIFEST).read_text())["files"]
    target = {"model": {"w": torch.zeros(2, 3)}}
    dcp.load(target, checkpoint_id=loaded.path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])

    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    _flip_byte(shard, offset=0)
    assert verify_checkpoint(path) == f"crc32 mismatch for {shard.name} in bytes 0-{shard.stat().st_size}"


def test_commit_of_an_empty_temp_dir_fails(tmp_path: Path) -> None:
    tmp = new_temp_dir(tmp_path, 1)
    with pytest.raises(CheckpointError, match="no files"):
        commit_checkpoint(tmp_path, 1, tmp)
    assert list(tmp_path.iterdir()) == []


DCP_WORKER = """
import sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpuwatch.trainer.checkpoint import commit_checkpoint, load_latest, new_temp_dir

ckpt_dir, step = sys.argv[1], 12
dist.init_process_group("gloo")
rank = dist.get_rank()
state_dict = {f"shard{rank}": torch.full((4,), float(rank + 1))}

name = [str(new_temp_dir(ckpt_dir, step)) if rank == 0 else None]
dist.broadcast_object_list(name, src=0)
dcp.save(state_dict, checkpoint_id=name[0])
dist.barrier()
if rank == 0:
    commit_checkpoint(ckpt_dir, step, name[0])
dist.barrier()

loaded = load_latest(ckpt_dir, allow_code_execution=True)
target = {f"shard{rank}": torch.zeros(4)}
dcp.load(target, checkpoint_id=loaded.path)
assert loaded.step == step and torch.equal(target[f"shard{rank}"], state_dict[f"shard{rank}"])
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_dcp_recipe_with_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "dcp_worker.py"
    script.write_text(DCP_WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*command, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=180
    )

    assert result.returncode == 0, result.stderr
    files = json.loads((tmp_path / "ckpt" / "step-00000012" / MANIFEST).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


# -- single writer: the rescue's save, no barrier, several survivors at once ----------------------

SURVIVOR = """
import sys, torch
from gpuwatch.trainer.checkpoint import save_checkpoint
go = sys.stdin.readline()  # all survivors start together
print(save_checkpoint(sys.argv[1], 7, {"w": torch.full((256, 256), 7.0), "by": sys.argv[2]}, single_writer=True))
"""


def test_single_writer_needs_no_barrier_and_ignores_the_rank(tmp_path: Path) -> None:
    def barrier() -> None:
        raise AssertionError("a rescue must not call a collective")

    path = save_checkpoint(tmp_path, 5, _state(5), rank=3, barrier=barrier, single_writer=True)

    assert path == tmp_path / "step-00000005" and verify_checkpoint(path) is None
    assert (tmp_path / LATEST).read_text() == "step-00000005\n"


@pytest.mark.slow
def test_survivors_saving_the_same_step_at_once_leave_one_verified_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    survivors = [
        subprocess.Popen(
            [sys.executable, "-c", SURVIVOR, str(tmp_path), str(i)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(3)
    ]  # fmt: skip
    for proc in survivors:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [proc.communicate(timeout=120) for proc in survivors]

    assert [proc.returncode for proc in survivors] == [0, 0, 0], [err for _, err in results]
    assert {out.strip() for out, _ in results} == {str(tmp_path / "step-00000007")}
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000007"]  # no temp dir left
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 7 and loaded.state["by"] in {"0", "1", "2"}


def test_single_writer_keeps_a_verified_checkpoint_and_replaces_a_damaged_one(tmp_path: Path) -> None:
    first = save_checkpoint(tmp_path, 7, _state(7), single_writer=True)
    inode = first.stat().st_ino
    save_checkpoint(tmp_path, 7, {"other": 1}, single_writer=True)
    assert first.stat().st_ino == inode  # kept: another survivor's save is as good as ours

    _flip_byte(first / "state.flat")
    save_checkpoint(tmp_path, 7, _state(7), single_writer=True)
    assert verify_checkpoint(first) is None
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.state["note"] == "at 7"


def test_single_writer_leaves_another_survivors_temp_dir_of_the_same_step(tmp_path: Path) -> None:
    _save_steps(tmp_path, 4)
    other = tmp_path / ".tmp-step-7-999999"  # another survivor, still writing
    other.mkdir()
    stale = tmp_path / ".tmp-step-5-999999"
    stale.mkdir()

    save_checkpoint(tmp_path, 7, _state(7), single_writer=True)

    assert other.is_dir() and not stale.exists()


# -- what earlier versions wrote, and what a flat file cannot hold ---------------------------------


def _save_v1(directory: Path, step: int, state: object) -> Path:
    """A checkpoint exactly as manifest version 1 wrote it: torch.save into state.pt, sha256 per file."""
    import hashlib

    final = directory / f"step-{step:08d}"
    final.mkdir(parents=True)
    torch.save(state, final / "state.pt")
    data = (final / "state.pt").read_bytes()
    files = {"state.pt": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    manifest = {"version": 1, "step": step, "t": 0.0, "state_file": "state.pt", "files": files}
    (final / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (directory / LATEST).write_text(f"{final.name}\n")
    return final


def test_a_checkpoint_written_by_manifest_version_1_still_loads_and_verifies(tmp_path: Path) -> None:
    path = _save_v1(tmp_path, 20, _state(20))

    assert verify_checkpoint(path) is None
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 20 and torch.equal(loaded.state["w"], _state(20)["w"])

    save_checkpoint(tmp_path, 30, _state(30))  # a new save beside it, in the new format
    _flip_byte(tmp_path / "step-00000030" / "state.flat", offset=8192 + 5)
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 20  # falls back to the old one, which verifies
    assert loaded.skipped[0][0] == "step-00000030" and loaded.skipped[0][1].startswith("crc32 mismatch for state.flat")

    _flip_byte(path / "state.pt")
    assert verify_checkpoint(path) == "sha256 mismatch for state.pt"


class _Note:
    """A custom object: not a plain value, so the state goes through torch.save."""

    def __init__(self, text: str) -> None:
        self.text = text


def test_a_state_with_custom_objects_is_saved_with_torch_save_and_crc32(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 4, {"w": torch.ones(3), "note": _Note("hi")})

    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["state_file"] == "state.pt" and "crc32" in manifest["files"]["state.pt"]
    loaded = load_latest(tmp_path, allow_code_execution=True)
    assert loaded is not None and loaded.state["note"].text == "hi"


def test_latest_step_reads_the_manifest_only(tmp_path: Path) -> None:
    assert latest_step(tmp_path) is None
    _save_steps(tmp_path, 3, 8)
    (tmp_path / "step-00000008" / "state.flat").unlink()  # not read: the step comes from the manifest
    assert latest_step(tmp_path) == 8
    (tmp_path / LATEST).write_text("../elsewhere\n")
    assert latest_step(tmp_path) is None
