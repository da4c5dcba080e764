"""Recovery in place end to end on the CPU: a sim daemon (3 GPUs), `gpuwatch launch --in-place`, the
example trainer's 3 gloo ranks, and the job's own step logs.

Each fault leaves the two survivors in the same processes taking their next step within 3 s of the
decision (a quarantine) or the death, with every step logged once (0 lost, none repeated) and no
checkpoint read; the GPU that comes back (a release, a replacement) joins with the state from a
peer, and every rank's parameters then have the same checksum.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.inplace.jobs import (
    InPlaceRun,
    assert_no_step_lost_or_repeated,
    first_after,
    launch_in_place,
    post,
    sim_node,
)

pytestmark = pytest.mark.slow
NEXT_STEP_S = 3.0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DaemonProcess]:
    with sim_node(tmp_path / "node", gpus=3) as daemon:
        yield daemon


def _running(node: DaemonProcess, tmp_path: Path, steps: int = 100_000) -> tuple[InPlaceRun, dict[int, int]]:
    """A 3-rank job past step 20: the run, and each GPU's rank pid (from the daemon's view of the ranks)."""
    run = launch_in_place(node, tmp_path, steps)
    run.wait_for("3 ranks past step 20", lambda lines: len(run.ranks_at(20, 3)) == 3)
    ranks = node.get("/v1/trainers")["ranks"]
    assert sorted(r["gpu"] for r in ranks) == [0, 1, 2], ranks
    return run, {r["gpu"]: r["pid"] for r in ranks}


def _survivors_go_on(run: InPlaceRun, since: float, survivors: list[int]) -> float:
    """Seconds from `since` to the survivors' first step at world 2; asserts they lost and repeated nothing."""
    run.wait_for("the survivors at world 2", lambda lines: len({ln["pid"] for ln in lines if ln["world"] == 2}) == 2)
    lines = run.steps()
    first = first_after(lines, since, survivors, world=2)
    assert {ln["pid"] for ln in lines if ln["world"] == 2} == set(survivors)  # the same processes
    assert_no_step_lost_or_repeated(lines, survivors)
    change = first["change"]
    assert change["source"] == "held", change  # its own state: no checkpoint, no transfer
    return float(first["t"] - since)


def _grows_back(run: InPlaceRun, survivors: list[int]) -> tuple[int, float]:
    """Wait for 3 ranks again; the joiner's pid and its state transfer's seconds. Every rank's checksum is the same."""
    run.wait_for(
        "3 ranks again",
        lambda lines: len({ln["pid"] for ln in lines if ln["world"] == 3 and ln["generation"] > 2}) == 3,
    )
    lines = run.steps()
    newest = max(ln["generation"] for ln in lines)
    at = [ln for ln in lines if ln["generation"] == newest and ln["world"] == 3]
    joiner = next(pid for pid in {ln["pid"] for ln in at} if pid not in survivors)
    joined = min((ln for ln in at if ln["pid"] == joiner), key=lambda ln: ln["step"])
    assert joined["change"]["source"] == "peer", joined
    step = joined["step"]
    checksums = {ln["pid"]: ln["checksum"] for ln in lines if ln["step"] == step and ln["generation"] == newest}
    assert len(checksums) == 3 and len(set(checksums.values())) == 1, checksums
    assert_no_step_lost_or_repeated(lines, survivors)
    return joiner, float(joined["change"]["seconds"])


def _finish(run: InPlaceRun, *, loads: bool = False) -> str:
    """Stop the job (SIGTERM to the launcher, passed to the ranks); its stderr, which shows no checkpoint read."""
    run.process.send_signal(signal.SIGTERM)
    _, stderr = run.output()
    assert loads or "loaded checkpoint" not in stderr, stderr  # nothing was read from disk
    return stderr


def test_a_quarantined_gpu_leaves_the_survivors_go_on_and_it_rejoins_on_release(
    node: DaemonProcess, tmp_path: Path
) -> None:
    run, pids = _running(node, tmp_path)
    decided = post(node, "/v1/gpus/1/quarantine", {"reason": "test"})
    survivors = [pids[0], pids[2]]
    took = _survivors_go_on(run, decided, survivors)
    assert took <= NEXT_STEP_S, took
    deadline = time.monotonic() + 30
    while not (report := _report(node, pids[1])).get("ended"):
        assert time.monotonic() < deadline, report
        time.sleep(0.1)
    assert (report["ended"], report["recovery"]) == ("resume", "in_place")  # left with 75, after the others

    released = post(node, "/v1/gpus/1/release", {"reason": "test", "force": True})
    joiner, join_s = _grows_back(run, survivors)
    first = min((ln for ln in run.steps() if ln["pid"] == joiner), key=lambda ln: ln["t"])
    stderr = _finish(run)
    assert "left (exit 75)" in stderr and "GPU 1" in stderr and "released: a rank joins" in stderr, stderr
    print(
        f"\nin place, quarantine: survivors' next step {took:.2f} s after the decision; release -> the joiner's"
        f" first step {first['t'] - released:.2f} s (its state transfer {join_s:.2f} s), checksums equal"
    )


def test_a_killed_rank_leaves_the_survivors_stepping_and_a_replacement_joins(
    node: DaemonProcess, tmp_path: Path
) -> None:
    run, pids = _running(node, tmp_path)
    killed = time.time()
    os.kill(pids[2], signal.SIGKILL)
    survivors = [pids[0], pids[1]]
    took = _survivors_go_on(run, killed, survivors)
    assert took <= NEXT_STEP_S, took
    joiner, join_s = _grows_back(run, survivors)
    assert joiner != pids[2]
    stderr = _finish(run)
    assert "killed by SIGKILL: the others go on" in stderr and "replacement 1/3: a rank joins" in stderr, stderr
    print(
        f"\nin place, SIGKILL: survivors' next step {took:.2f} s after the death;"
        f" replacement joined, state {join_s:.2f} s"
    )


def test_a_frozen_rank_killed_after_the_hang_leaves_the_survivors_stepping(node: DaemonProcess, tmp_path: Path) -> None:
    run, pids = _running(node, tmp_path)
    os.kill(pids[1], signal.SIGSTOP)  # the survivors block in the next all-reduce (gloo cannot be aborted)
    time.sleep(2.0)
    lines = run.steps()
    stuck = max(ln["step"] for ln in lines)
    assert all(ln["step"] <= stuck for ln in lines)
    killed = time.time()
    os.kill(pids[1], signal.SIGKILL)  # what the daemon does to a frozen rank after its hang rule fired
    survivors = [pids[0], pids[2]]
    took = _survivors_go_on(run, killed, survivors)
    assert took <= NEXT_STEP_S, took
    assert first_after(run.steps(), killed, survivors, world=2)["step"] == stuck + 1
    _finish(run)
    print(f"\nin place, a frozen rank SIGKILLed: survivors' next step {took:.2f} s after the kill, step {stuck + 1}")


def _report(node: DaemonProcess, pid: int) -> dict[str, object]:
    """Rank `pid`'s latest report as the daemon holds it (also after the rank ended), or {}."""
    return next((r for r in node.trainer_reports() if r["pid"] == pid), {})


def test_with_no_survivor_the_replacement_loads_the_checkpoint(tmp_path: Path) -> None:
    """A single-rank job whose rank dies: nobody holds the state, so the new rank loads (the old path)."""
    with sim_node(tmp_path / "one", gpus=1) as one:
        run = launch_in_place(one, tmp_path, 100_000, ckpt_every=10)
        run.wait_for("step 25", lambda lines: any(ln["step"] >= 25 for ln in lines))
        (victim,) = {ln["pid"] for ln in run.steps()}
        os.kill(victim, signal.SIGKILL)
        furthest = max(ln["step"] for ln in run.steps())
        run.wait_for("a new rank", lambda lines: any(ln["pid"] != victim for ln in lines))
        first = min((ln for ln in run.steps() if ln["pid"] != victim), key=lambda ln: ln["step"])
        stderr = _finish(run, loads=True)
    assert first["change"]["source"] == "checkpoint" and first["step"] == furthest // 10 * 10 + 1, first
    assert f"loaded checkpoint step {furthest // 10 * 10}" in stderr, stderr
