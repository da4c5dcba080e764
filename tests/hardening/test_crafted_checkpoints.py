"""A checkpoint is data: each crafted newest checkpoint is skipped with its reason, the older good one loads.

Each case runs `load_latest` in a child process with a deadline: a crafted file that runs code
leaves a marker file, one that blocks or reads forever runs into the deadline. Whoever can write
the checkpoint directory (a shared scratch dir, a downloaded checkpoint) crafts them; no second
user is needed to play the attacker.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpuwatch.trainer.checkpoint import LATEST, MANIFEST, save_checkpoint

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")

REPO = Path(__file__).resolve().parents[2]
GOOD, CRAFTED = 10, 20
LOAD = """
import sys
from gpuwatch.trainer.checkpoint import load_latest
loaded = load_latest(sys.argv[1])
print(loaded.step, float(loaded.state["w"][0]))
for name, reason in loaded.skipped:
    print("skipped", name, reason)
"""


class _RunsCode:
    """Unpickling this runs a shell command: what a crafted state.pkl holds."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (self.command,)


def _v1_checkpoint(directory: Path, state_file: str, make: Callable[[Path], None]) -> Path:
    """A version-1 checkpoint of step CRAFTED whose manifest names `state_file` with the sha256 it has now."""
    path = directory / f"step-{CRAFTED:08d}"
    path.mkdir()
    make(path / state_file)
    entry: dict[str, object] = {"size": 0, "sha256": hashlib.sha256().hexdigest()}
    if (path / state_file).is_file():
        data = (path / state_file).read_bytes()
        entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"version": 1, "step": CRAFTED, "state_file": state_file, "files": {state_file: entry}}
    (path / MANIFEST).write_text(json.dumps(manifest))
    (directory / LATEST).write_text(f"{path.name}\n")
    return path


def _pickle_that_runs(marker: Path) -> Callable[[Path], None]:
    def make(file: Path) -> None:
        file.write_bytes(pickle.dumps({"w": _RunsCode(f"id > {marker}")}))

    return make


def _fifo(file: Path) -> None:
    os.mkfifo(file)


def _link_to(target: Path) -> Callable[[Path], None]:
    return lambda file: file.symlink_to(target)


def _outside_state(tmp_path: Path) -> Path:
    """A valid torch.save file outside the checkpoint directory, with a state the test would recognise."""
    outside = tmp_path / "outside.pt"
    torch.save({"w": torch.full((2,), 666.0)}, outside)
    return outside


def _huge_chunk(directory: Path) -> Path:
    """A copy of the good checkpoint whose manifest adds a 1 TiB (sparse) file checked as one 1 TiB chunk."""
    path = save_checkpoint(directory, CRAFTED, {"w": torch.full((2,), 20.0)}, keep=5)
    with open(path / "extra", "wb") as f:
        f.truncate(1 << 40)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["extra"] = {"size": 1 << 40, "crc32": [[0, 1 << 40, zlib.crc32(b"")]]}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def _deflated_state(file: Path) -> None:
    """A valid torch.save file whose records are deflated: a few hundred KiB that inflate to 256 MiB."""
    plain = file.with_suffix(".plain")
    torch.save({"w": torch.full((2,), 20.0), "pad": torch.zeros(64 << 20)}, plain)
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(file, "w", zipfile.ZIP_DEFLATED) as crafted:
        for record in source.infolist():
            crafted.writestr(record.filename, source.read(record), zipfile.ZIP_DEFLATED, 9)
    plain.unlink()


def _load_in_child(directory: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", LOAD, str(directory)], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.parametrize(
    "case",
    [
        "pickle-runs-id",
        "pt-is-a-fifo",
        "pt-links-to-dev-zero",
        "pt-links-outside",
        "chunk-of-1-tib",
        "latest-is-fifo",
        "pt-inflates-1000-fold",
    ],  # fmt: skip
)
@pytest.mark.slow
def test_a_crafted_newest_checkpoint_falls_back_to_the_older_good_one(tmp_path: Path, case: str) -> None:
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, GOOD, {"w": torch.full((2,), float(GOOD))}, keep=5)
    marker = tmp_path / "ran-code"
    expected = {
        "pickle-runs-id": "state.pkl holds more than plain values",
        "pt-is-a-fifo": "state.pt is not a regular file (a FIFO)",
        "pt-links-to-dev-zero": "cannot open state.pt: a symbolic link",
        "pt-links-outside": "cannot open state.pt: a symbolic link",
        "chunk-of-1-tib": "manifest.json has a chunk of 1099511627776 bytes for extra",
        "pt-inflates-1000-fold": "state.pt: compressed record",
    }
    if case == "pickle-runs-id":
        _v1_checkpoint(directory, "state.pkl", _pickle_that_runs(marker))
    elif case == "pt-is-a-fifo":
        _v1_checkpoint(directory, "state.pt", _fifo)
    elif case == "pt-links-to-dev-zero":
        _v1_checkpoint(directory, "state.pt", _link_to(Path("/dev/zero")))
    elif case == "pt-links-outside":
        _v1_checkpoint(directory, "state.pt", _link_to(_outside_state(tmp_path)))
    elif case == "chunk-of-1-tib":
        _huge_chunk(directory)
    elif case == "pt-inflates-1000-fold":
        _v1_checkpoint(directory, "state.pt", _deflated_state)
    else:  # `latest` a FIFO: read with O_NONBLOCK and refused; the newest step-* that verifies loads
        (directory / LATEST).unlink()
        os.mkfifo(directory / LATEST)

    result = _load_in_child(directory)

    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"{GOOD} {float(GOOD)}"
    assert not marker.exists(), "the crafted checkpoint ran code"
    if case in expected:
        assert lines[1].startswith(f"skipped step-{CRAFTED:08d} {expected[case]}"), lines


@pytest.mark.slow
def test_a_manifest_or_step_dir_that_is_a_link_is_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, GOOD, {"w": torch.full((2,), float(GOOD))}, keep=5)
    elsewhere = save_checkpoint(tmp_path / "elsewhere", CRAFTED, {"w": torch.full((2,), 666.0)})
    (directory / f"step-{CRAFTED:08d}").symlink_to(elsewhere)  # a whole step dir read from outside
    (directory / LATEST).write_text(f"step-{CRAFTED:08d}\n")

    result = _load_in_child(directory)

    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == f"{GOOD} {float(GOOD)}"
