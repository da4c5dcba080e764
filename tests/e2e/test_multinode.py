"""A two-node job on one machine: two sim daemons (own dirs, ports, seeds), two `gpuwatch launch
--nnodes 2` with c10d rendezvous, real torchrun and the example trainer on gloo, one checkpoint
directory both nodes see (as a shared filesystem would be on a real fleet).

* A quarantine on node B: every rank stops at the same step, rank 0 checkpoints, both launchers
  relaunch (B on its one GPU left) and the job finishes on 3 ranks with no step lost.
* Node B drops out (its daemon and its launcher killed): node A's ranks see their peer gone in the
  next collective, torchrun on A exits, and A's launcher ends with torchrun's code and one line,
  within seconds; the checkpoint directory keeps the last verified checkpoint to restart from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import RunningDaemon, free_port, start_daemon, stop_daemon

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[RunningDaemon, RunningDaemon]]:
    started = []
    for name, seed in (("a", "1"), ("b", "2")):
        (tmp_path / name).mkdir()
        args = ("--sim-scenario", "healthy", "--sim-gpus", "2", "--interval", "1", "--seed", seed)
        started.append(start_daemon(tmp_path / name, *args))
    yield started[0], started[1]
    for daemon in started:
        if daemon.process.poll() is None:
            stop_daemon(daemon)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "TORCHELASTIC_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return {**env, "PYTHONPATH": str(REPO)}


def _launch(node: RunningDaemon, ckpt: Path, steps: int, *launch_args: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
        "--max-restarts", "2", *launch_args,
        "--", "-m", "gpuwatch.trainer.example", "--ckpt-dir", str(ckpt), "--steps", str(steps),
        "--step-sleep", "0.1", "--ckpt-every", "10", "--report-interval", "0.2",
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=_env(), cwd=ckpt.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _two_nodes(job: str) -> tuple[str, ...]:
    return ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun and its ranks run in sessions of their own: no process group kill)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def _ranks(node: RunningDaemon) -> list[dict[str, object]]:
    return list(node.get("/v1/trainers")["ranks"])


def _wait_for_steps(a: RunningDaemon, b: RunningDaemon, step: int, launchers: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        ranks = _ranks(a) + _ranks(b)
        if len(ranks) == 4 and all(int(str(r.get("step") or 0)) >= step for r in ranks):
            return
        for proc in launchers:
            assert proc.poll() is None, f"launch exited {proc.returncode} early: {proc.communicate()}"
        time.sleep(0.2)
    raise AssertionError(f"the 4 ranks did not reach step {step}: {_ranks(a) + _ranks(b)}")


def _summary(stdout: str) -> dict[str, object] | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return None


def test_quarantine_on_node_b_finishes_the_job_on_three_ranks_with_no_step_lost(
    nodes: tuple[RunningDaemon, RunningDaemon], tmp_path: Path
) -> None:
    a, b = nodes
    ckpt, rdzv = tmp_path / "ckpt", _two_nodes("two-nodes")
    launchers = [_launch(a, ckpt, 120, *rdzv), _launch(b, ckpt, 120, *rdzv)]
    try:
        _wait_for_steps(a, b, 20, launchers)
        assert b.cli("quarantine", "1", "--reason", "test").returncode == 0
        outputs = [proc.communicate(timeout=TIMEOUT_S) for proc in launchers]
    finally:
        for proc in launchers:
            _kill_tree(proc)
    assert [proc.returncode for proc in launchers] == [0, 0], outputs
    summaries = [s for s in (_summary(out) for out, _ in outputs) if s is not None]
    assert len(summaries) == 1, outputs  # rank 0 prints it, on whichever node it is
    summary = summaries[0]
    assert summary["world_sizes"] == [4, 3] and summary["lost_steps"] == 0, summary
    assert (summary["steps_done"], summary["restarts"]) == (120, 1)
    assert "GPU 1" in outputs[1][1] and "quarantined: test" in outputs[1][1]


def test_node_b_dropping_out_ends_the_job_within_seconds_and_it_resumes_from_the_shared_checkpoint(
    nodes: tuple[RunningDaemon, RunningDaemon], tmp_path: Path
) -> None:
    a, b = nodes
    ckpt, rdzv = tmp_path / "ckpt", _two_nodes("drop-out")
    launchers = [_launch(a, ckpt, 90, *rdzv), _launch(b, ckpt, 90, *rdzv)]
    try:
        _wait_for_steps(a, b, 25, launchers)
        for pid in [b.process.pid, launchers[1].pid, *_descendants(launchers[1].pid)]:  # node B dies whole
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launchers[0].communicate(timeout=TIMEOUT_S)
        took = time.monotonic() - killed
    finally:
        for proc in launchers:
            _kill_tree(proc)
    print(f"\nnode drop-out: node A's launcher exited {launchers[0].returncode} {took:.1f} s after node B died")
    assert launchers[0].returncode not in (0, None)
    assert stderr.strip().splitlines()[-1].startswith("gpuwatch launch: error: torchrun exited"), stderr[-2000:]
    assert took < 60

    # The job is restarted on node A alone (what Slurm's requeue or an operator does): it resumes from
    # the last checkpoint in the shared directory, losing at most the steps since it (--ckpt-every 10).
    again = _launch(a, ckpt, 90, "--rdzv-id", "drop-out")
    try:
        stdout, stderr = again.communicate(timeout=TIMEOUT_S)
    finally:
        _kill_tree(again)
    assert again.returncode == 0, stderr[-2000:]
    summary = _summary(stdout)
    assert summary is not None, stdout
    assert summary["world_sizes"] == [4, 2] and summary["steps_done"] == 90, summary
    assert 0 <= int(str(summary["lost_steps"])) <= 10, summary
