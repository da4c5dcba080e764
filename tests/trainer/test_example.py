"""The example trainer under real torchrun (gloo, CPU): completion, stop-and-resume on fewer ranks.

What torchrun does with a worker's exit code 75 (torch 2.13, measured here): torchrun itself
exits 1 (ChildFailedError), whatever the code. Its log names the code ("exitcode  : 75" under
"Root Cause"); the other worker gets SIGTERM and is listed with -15 if it had not exited yet.
The worker writes torchelastic's per-worker error file before exiting (TrainerLink.exit_for_resume),
so when torchrun itself runs with TORCHELASTIC_ERROR_FILE set, torchrun copies the root cause's
file there with `"errorCode": 75`: that file, not torchrun's exit status, is how a launcher
tells "stopped for resume" from a crash.
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
from gpuwatch.trainer import EXIT_RESUME
from tests.reporting import ServeReports, reports_by_rank

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def _torchrun(nproc: int, *args: str) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*command, "-m", "gpuwatch.examples.trainer", *args]


def _env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "TORCHELASTIC_"))}
    env.update({"GPUWATCH_RUNTIME_DIR": str(runtime_dir), "PYTHONPATH": str(REPO), **extra})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _summary(stdout: str) -> dict[str, Any]:
    last = stdout.strip().splitlines()[-1]
    summary: dict[str, Any] = json.loads(last)
    return summary


def _wait_for_steps(
    proc: subprocess.Popen[str], runtime: RuntimeDir, *, ranks: int, step: int
) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        reports = reports_by_rank(runtime)
        if len(reports) == ranks and all((r["step"] or 0) >= step for r in reports.values()):
            return reports
        assert proc.poll() is None, f"torchrun exited {proc.returncode} early: {proc.communicate()}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"ranks did not reach step {step}: {proc.communicate()}")


def test_two_ranks_run_to_completion(tmp_path: Path, serve_reports: ServeReports) -> None:
    runtime = serve_reports(tmp_path / "run")
    ckpt = tmp_path / "ckpt"
    result = subprocess.run(
        _torchrun(2, "--steps", "20", "--ckpt-dir", str(ckpt), "--ckpt-every", "8"),
        env=_env(tmp_path / "run"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )

    assert result.returncode == 0, result.stderr
    summary = _summary(result.stdout)
    assert summary == {"steps_done": 20, "restarts": 0, "resumed_from_steps": [], "world_sizes": [2], "lost_steps": 0}
    assert (ckpt / "latest").read_text() == "step-00000020\n"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000008", "step-00000016", "step-00000020"]
    finals = reports_by_rank(runtime)  # each rank left its final report with the daemon
    assert sorted((r["rank"], r["first_step"], r["step"], r["ended"]) for r in finals.values()) == [
        (0, 1, 20, "finished"),
        (1, 1, 20, "finished"),
    ]


def test_stop_request_checkpoints_exits_75_and_resumes_on_fewer_ranks(
    tmp_path: Path, serve_reports: ServeReports
) -> None:
    runtime_dir, ckpt, agent_error = tmp_path / "run", tmp_path / "ckpt", tmp_path / "torchrun-error.json"
    runtime = serve_reports(runtime_dir)
    args = ["--steps", "400", "--ckpt-dir", str(ckpt), "--report-interval", "0.1"]
    proc = subprocess.Popen(
        _torchrun(2, *args, "--step-sleep", "0.02"),
        env=_env(runtime_dir, TORCHELASTIC_ERROR_FILE=str(agent_error)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    reports = _wait_for_steps(proc, runtime, ranks=2, step=30)
    os.kill(reports[1]["pid"], signal.SIGUSR1)  # what the daemon does: signal the rank on the bad GPU only
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)

    # torchrun reports any worker failure as 1; the 75 is in its log and in its error file.
    assert proc.returncode == 1, stderr
    assert f"exitcode  : {EXIT_RESUME} (pid: " in stderr
    error = json.loads(agent_error.read_text())["message"]
    assert error["errorCode"] == EXIT_RESUME
    assert error["message"].startswith("gpuwatch: stopped for resume (")

    stop_step = int((ckpt / "latest").read_text().removeprefix("step-"))
    assert 30 <= stop_step < 400
    assert f"rank 0: stopping at step {stop_step}: another rank was asked to stop" in stdout
    assert json.loads((ckpt / "progress.json").read_text())["launches"][0]["furthest"] == stop_step

    result = subprocess.run(
        _torchrun(1, *args),
        env=_env(runtime_dir, GPUWATCH_RESUME="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )

    assert result.returncode == 0, result.stderr
    assert f"rank 0: resuming from step {stop_step}" in result.stdout
    assert _summary(result.stdout) == {
        "steps_done": 400,
        "restarts": 1,
        "resumed_from_steps": [stop_step],
        "world_sizes": [2, 1],
        "lost_steps": 0,
    }


def test_ignore_stop_keeps_training(tmp_path: Path, serve_reports: ServeReports) -> None:
    runtime_dir = tmp_path / "run"
    runtime = serve_reports(runtime_dir)
    args = ["--steps", "2000", "--ckpt-dir", str(tmp_path / "ckpt"), "--report-interval", "0.1", "--ignore-stop"]
    proc = subprocess.Popen(
        _torchrun(2, *args, "--step-sleep", "0.02"),
        env=_env(runtime_dir),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        reports = _wait_for_steps(proc, runtime, ranks=2, step=10)
        for report in reports.values():
            os.kill(report["pid"], signal.SIGUSR1)
        reports = _wait_for_steps(proc, runtime, ranks=2, step=reports[0]["step"] + 30)
        assert all(report["stop_requested"] for report in reports.values())
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the workers and exits 1
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert "ignoring stop request (signal SIGUSR1): --ignore-stop" in stderr


def test_a_step_logged_just_before_a_kill_counts_as_lost(tmp_path: Path, serve_reports: ServeReports) -> None:
    """A kill between the step log's line and progress.json's write: the relaunch counts that step from the log."""
    serve_reports(tmp_path / "run")
    ckpt = tmp_path / "ckpt"
    args = ["--ckpt-dir", str(ckpt), "--ckpt-every", "10"]
    first = subprocess.run(
        _torchrun(1, "--steps", "12", *args),
        env=_env(tmp_path / "run"), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    with (ckpt / "steps.jsonl").open("a") as log:  # step 13 finished and logged; SIGKILL before progress.json
        log.write(json.dumps({"step": 13, "t": time.time()}) + "\n")

    second = subprocess.run(
        _torchrun(1, "--steps", "15", *args),
        env=_env(tmp_path / "run", GPUWATCH_RESUME="1"), cwd=tmp_path, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip

    assert second.returncode == 0, second.stderr
    summary = _summary(second.stdout)
    assert (summary["resumed_from_steps"], summary["lost_steps"]) == ([12], 1)
