"""The example trainer under real torchrun (2 ranks, gloo): both ranks SIGKILLed at once, no survivor.

The relaunch (same job id, as `gpuwatch launch` runs it) must resume out of host memory, lose at most
K steps counted from the job's own step log, and read no checkpoint: every checkpoint on disk is
corrupted before the relaunch, so a disk load would be refused ("skipped checkpoint") and fail the
job. When the job finishes its slots are gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.node.runtime import RuntimeDir
from tests.reporting import ServeReports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180
K = 3
JOB = "kill-both"


def _torchrun(nproc: int, *args: str) -> list[str]:
    """torchrun as `gpuwatch launch` runs it: a local c10d store, the run id pinned to the job id."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", "localhost:0", "--rdzv-id", JOB, "--max-restarts", "0", f"--nproc-per-node={nproc}"]
    return [*command, "-m", "gpuwatch.examples.trainer", *args]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "TORCHELASTIC_"))}
    (tmp_path / "shm").mkdir(exist_ok=True)
    env.update(
        GPUWATCH_RUNTIME_DIR=str(tmp_path / "run"), GPUWATCH_SNAPSHOT_ROOT=str(tmp_path / "shm"), PYTHONPATH=str(REPO)
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _pids_at_step(proc: subprocess.Popen[str], runtime: RuntimeDir, step: int) -> list[int]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        reports = [r.info for r in runtime.read_reports() if r.running]
        if len(reports) == 2 and all((r.step or 0) >= step for r in reports):
            return [r.pid for r in reports]
        assert proc.poll() is None, f"torchrun exited {proc.returncode} early: {proc.communicate()}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"ranks did not reach step {step}: {proc.communicate()}")


def _step_log(ckpt: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines()]


def _launches(log: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The log split per launch: each starts with its {"launch", "resumed_from", "source"} line."""
    launches: list[list[dict[str, Any]]] = []
    for line in log:
        if "launch" in line:
            launches.append([])
        launches[-1].append(line)
    return launches


def test_both_ranks_killed_resume_from_host_memory_within_k_steps_without_reading_the_disk(
    tmp_path: Path, serve_reports: ServeReports
) -> None:
    runtime = serve_reports(tmp_path / "run")
    ckpt = tmp_path / "ckpt"
    args = ["--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--snapshot-every", str(K), "--report-interval", "0.1"]
    first = subprocess.Popen(
        _torchrun(2, "--steps", "100000", *args, "--step-sleep", "0.02"),
        env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for pid in _pids_at_step(first, runtime, 26):
        os.kill(pid, signal.SIGKILL)  # both at once: no survivor to rescue anything
    first.communicate(timeout=TIMEOUT_S)
    assert first.returncode != 0

    (killed,) = _launches(_step_log(ckpt))
    furthest = killed[-1]["step"]
    saved = sorted(ckpt.glob("step-*"))
    assert saved, "the periodic checkpoints were written (from host memory)"
    for state in (path / "state.flat" for path in saved):  # any disk read from here on fails verification
        data = bytearray(state.read_bytes())
        data[0] ^= 0xFF
        state.write_bytes(bytes(data))

    second = subprocess.run(
        _torchrun(2, "--steps", str(furthest + 6), *args),
        env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip

    assert second.returncode == 0, second.stderr
    _, relaunch = _launches(_step_log(ckpt))
    resumed = relaunch[0]
    assert resumed["source"] == "memory"
    lost = furthest - resumed["resumed_from"]
    assert 0 <= lost <= K, (furthest, resumed)
    assert relaunch[1]["step"] == resumed["resumed_from"] + 1 and relaunch[-1]["step"] == furthest + 6
    for rank in (0, 1):
        assert f"rank {rank}: resuming from step {resumed['resumed_from']} (memory: " in second.stdout
    assert "skipped checkpoint" not in second.stdout + second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["lost_steps"] == lost and summary["resumed_from_steps"] == [resumed["resumed_from"]]
    assert not (tmp_path / "shm" / f"gpuwatch-{os.getuid()}" / f"job-{JOB}").exists()  # finished: slots removed
    print(f"\nkilled after step {furthest}, resumed from host memory at {resumed['resumed_from']}: {lost} lost (K={K})")
