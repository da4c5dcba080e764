"""A two-node job on one machine: two sim daemons (own dirs, ports, seeds), two `gpuwatch launch
--nnodes 2` with c10d rendezvous, real torchrun and the example trainer on gloo, one checkpoint
directory both nodes see (as a shared filesystem would be on a real fleet).

* A quarantine on node B: every rank stops at the same step, rank 0 checkpoints, both launchers
  relaunch (B on its one GPU left) and the job finishes on 3 ranks with no step lost.
* Node B drops out (its daemon, launcher, torchrun and ranks killed): node A's ranks see their peer
  gone in the next collective, save the last step (rescue) and exit 75, and A's launcher relaunches.
  With `--nnodes 1:2` torchrun forms the job again from node A alone after `last_call_timeout` and it
  finishes with no step lost; with `--nnodes 2` torchrun waits for a second node `join_timeout` and
  fails, and the launcher stops (exit 3), bounded in time, the checkpoint kept for a restart.
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

from gpuwatch.testing.daemon_process import DaemonProcess, free_port
from tests.helpers import launch_env

pytestmark = pytest.mark.slow
TIMEOUT_S = 120


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    args = ("--sim-scenario", "healthy", "--sim-gpus", "2", "--interval", "1")
    with (
        DaemonProcess(tmp_path / "a", *args, "--seed", "1") as a,
        DaemonProcess(tmp_path / "b", *args, "--seed", "2") as b,
    ):
        yield a, b


def _launch(node: DaemonProcess, ckpt: Path, steps: int, *launch_args: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
        "--max-restarts", "2", *launch_args,
        "--", "-m", "gpuwatch.examples.trainer", "--ckpt-dir", str(ckpt), "--steps", str(steps),
        "--step-sleep", "0.1", "--ckpt-every", "10", "--report-interval", "0.2",
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=launch_env(), cwd=ckpt.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _two_nodes(job: str, nnodes: str = "2", *conf: str) -> tuple[str, ...]:
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = ("--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job)
    return (*rdzv, *(("--rdzv-conf", ",".join(conf)) if conf else ()))


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


def _ranks(node: DaemonProcess) -> list[dict[str, object]]:
    return list(node.get("/v1/trainers")["ranks"])


def _wait_for_steps(a: DaemonProcess, b: DaemonProcess, step: int, launchers: list[subprocess.Popen[str]]) -> None:
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
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    a, b = nodes
    ckpt, rdzv = tmp_path / "ckpt", _two_nodes("two-nodes")
    launchers = [_launch(a, ckpt, 90, *rdzv), _launch(b, ckpt, 90, *rdzv)]
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
    assert (summary["steps_done"], summary["restarts"]) == (90, 1)
    assert "GPU 1" in outputs[1][1] and "quarantined: test" in outputs[1][1]


def _drop_node_b(
    a: DaemonProcess, b: DaemonProcess, launchers: list[subprocess.Popen[str]]
) -> tuple[float, tuple[str, str]]:
    """Kill node B whole (daemon, launcher, torchrun, ranks) at step 25; seconds until A's launcher ends, its output."""
    try:
        _wait_for_steps(a, b, 25, launchers)
        for pid in [b.process.pid, launchers[1].pid, *_descendants(launchers[1].pid)]:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        output = launchers[0].communicate(timeout=TIMEOUT_S)
        return time.monotonic() - killed, output
    finally:
        for proc in launchers:
            _kill_tree(proc)


def test_an_elastic_job_goes_on_without_a_node_that_dropped_out(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    """--nnodes 1:2: node A's ranks save the last step (rescue), its launcher relaunches and torchrun
    forms the job again from the nodes left once `last_call_timeout` has passed: no step lost."""
    a, b = nodes
    ckpt, rdzv = tmp_path / "ckpt", _two_nodes("elastic", "1:2", "last_call_timeout=10", "join_timeout=60")
    launchers = [_launch(a, ckpt, 90, *rdzv), _launch(b, ckpt, 90, *rdzv)]
    took, (stdout, stderr) = _drop_node_b(a, b, launchers)
    print(f"\nnode drop-out, --nnodes 1:2: the job finished on node A alone {took:.1f} s after node B died")
    assert launchers[0].returncode == 0, stderr[-3000:]
    summary = _summary(stdout)
    assert summary is not None, stdout[-2000:]
    assert summary["world_sizes"] == [4, 2] and summary["steps_done"] == 90, summary
    assert summary["lost_steps"] == 0, summary
    assert "rescued step" in stderr and "relaunch 1/2" in stderr, stderr[-3000:]


def test_a_fixed_size_job_waits_for_the_lost_node_only_until_the_join_timeout(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    """--nnodes 2: node A's launcher relaunches, torchrun waits at the rendezvous for a second node
    for `join_timeout` and fails; after a second such crash with no progress the launcher stops (exit 3). The
    checkpoint in the shared directory is where a restarted job resumes."""
    a, b = nodes
    ckpt, rdzv = tmp_path / "ckpt", _two_nodes("fixed", "2", "join_timeout=5")
    launchers = [_launch(a, ckpt, 90, *rdzv), _launch(b, ckpt, 90, *rdzv)]
    took, (_, stderr) = _drop_node_b(a, b, launchers)
    print(f"\nnode drop-out, --nnodes 2: node A's launcher exited {launchers[0].returncode} {took:.1f} s later")
    assert launchers[0].returncode == 3, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("gpuwatch launch: error: job fixed crashed twice"), stderr[-2000:]
    assert 5 <= took < 60  # the rendezvous waited join_timeout (twice), no longer
    assert (ckpt / "latest").exists()
