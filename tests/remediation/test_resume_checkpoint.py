"""Resume past a corrupt newest checkpoint: the example trainer skips it, says why, and counts the steps redone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _example(tmp_path: Path, steps: int, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "TORCHELASTIC_", "RANK"))}
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch.examples.trainer", "--steps", str(steps), "--ckpt-dir", str(tmp_path / "ckpt")]
        + ["--ckpt-every", "5"],
        env={**base, "PYTHONPATH": str(REPO), "GPUWATCH_RUNTIME_DIR": str(tmp_path / "run"), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_corrupt_newest_checkpoint_is_skipped_on_resume(tmp_path: Path) -> None:
    first = _example(tmp_path, 20)
    assert first.returncode == 0, first.stderr
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "step-00000020\n"
    state = ckpt / "step-00000020" / "state.flat"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip on disk: same size, wrong checksum
    state.write_bytes(bytes(data))

    resumed = _example(tmp_path, 30, GPUWATCH_RESUME="1")

    assert resumed.returncode == 0, resumed.stderr
    assert "rank 0: skipped checkpoint step-00000020: crc32 mismatch for state.flat" in resumed.stdout
    assert "rank 0: resuming from step 15" in resumed.stdout
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary == {
        "steps_done": 30,
        "restarts": 1,
        "resumed_from_steps": [15],
        "world_sizes": [1, 1],
        "lost_steps": 5,  # steps 16-20 were done twice
    }
    assert (ckpt / "latest").read_text() == "step-00000030\n"
