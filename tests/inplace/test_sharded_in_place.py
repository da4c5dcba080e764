"""Sharded state and one-rank jobs recover in place through a warm spare (CPU, gloo, sim daemon).

`gpuwatch launch --in-place --spares 1` runs gpuwatch.examples.sharded_worker (ZeroRedundancyOptimizer:
each rank holds its own shard of Adam's moments; a host snapshot every K steps). A SIGKILLed rank is
replaced by the spare, which reads the lost rank's host snapshot; every rank rolls back to the newest
step all of them hold, so the survivors keep their processes, nothing is read from disk, and each
rank's own step log shows at most K steps redone and none missing. The daemon's incident of the kill
records the path `spare`, with its onset → next step time and the steps redone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.hardware.hang_drill import spare_warm
from tests.inplace.jobs import InPlaceRun, by_pid, check_rank_log, kill_when_warm, launch_sharded, sim_node

pytestmark = pytest.mark.slow
K = 3
NEXT_STEP_S = 3.0
STEPS = 300


def _kill_when_warm(run: InPlaceRun, ranks: int, rank: int) -> tuple[int, float]:
    return kill_when_warm(run, ranks, rank, K)


def _spare_incident(node: DaemonProcess, victim: int) -> dict[str, Any]:
    """The daemon's incident of the victim's death once its watch ended (the job came back): it records the
    path `spare` (the daemon learnt from the replacement's own report that a spare took the rank over)."""
    deadline = time.monotonic() + 30
    while True:
        found = [i for i in node.get("/v1/incidents")["incidents"] if victim in {r["pid"] for r in i["ranks"]}]
        if found and found[0]["status"] == "resumed":
            incident: dict[str, Any] = found[0]
            break
        assert time.monotonic() < deadline, f"no resumed incident of pid {victim}: {found}"
        time.sleep(0.2)
    assert incident["kind"] == "rank_died" and incident["path"] == "spare", incident
    assert 0 <= incident["steps_lost"] <= K and incident["time_to_resume_s"] <= NEXT_STEP_S, incident
    return incident


def _check_rank_log(own: list[dict[str, Any]], resumed: int) -> int:
    return check_rank_log(own, resumed, K)


def test_a_killed_shard_is_taken_over_by_a_spare_and_every_rank_rolls_back_at_most_k(tmp_path: Path) -> None:
    with sim_node(tmp_path / "node", gpus=3) as node:
        run = launch_sharded(node, tmp_path, STEPS, "--spares", "1", every=K, step_sleep=0.02)
        victim, killed = _kill_when_warm(run, 3, rank=1)
        out, err = run.output(90)
        incident = _spare_incident(node, victim)
    assert run.process.returncode == 0, err
    lines = run.steps()
    logs = by_pid(lines)
    survivors = sorted(pid for pid in logs if pid != victim and any(ln["t"] < killed for ln in logs[pid]))
    (spare,) = [pid for pid in logs if pid not in (*survivors, victim)]
    assert len(survivors) == 2 and all(
        logs[pid][-1]["step"] == STEPS for pid in survivors
    )  # same processes, to the end
    took_over = logs[spare][0]
    assert took_over["rank"] == 1 and took_over["spare_warm_s"] is not None, took_over  # a warm spare, its rank
    assert took_over["change"]["source"] == "memory", took_over  # the lost rank's host snapshot
    first = min((ln for ln in lines if ln["t"] > killed), key=lambda ln: ln["t"])
    assert first["t"] - killed <= NEXT_STEP_S, first["t"] - killed
    resumed = took_over["step"]
    redone = {pid: _check_rank_log(logs[pid], resumed) for pid in survivors}
    redone[victim] = _check_rank_log([*logs[victim], *logs[spare]], resumed)
    for step in (resumed, STEPS):
        at = {ln["pid"]: ln["checksum"] for ln in lines if ln["step"] == step and ln["t"] > killed}
        assert len(at) == 3 and len(set(at.values())) == 1, (step, at)
    assert "a spare (pid" in err and "loaded checkpoint" not in err, err
    print(
        f"\nsharded, SIGKILL of rank 1: next step {first['t'] - killed:.2f} s after the kill, redone {redone};"
        f" incident: path {incident['path']}, {incident['time_to_resume_s']} s, {incident['steps_lost']} redone"
    )


def test_a_one_rank_job_killed_is_taken_over_by_a_spare_from_its_host_snapshot(tmp_path: Path) -> None:
    with sim_node(tmp_path / "node", gpus=1) as node:
        run = launch_sharded(node, tmp_path, STEPS, "--spares", "1", every=K, step_sleep=0.02)
        victim, killed = _kill_when_warm(run, 1, rank=0)
        out, err = run.output(90)
        incident = _spare_incident(node, victim)
    assert run.process.returncode == 0, err
    logs = by_pid(run.steps())
    (spare,) = [pid for pid in logs if pid != victim]
    took_over = logs[spare][0]
    assert took_over["spare_warm_s"] is not None and took_over["change"]["source"] == "memory", took_over
    assert took_over["t"] - killed <= NEXT_STEP_S, took_over["t"] - killed
    redone = _check_rank_log([*logs[victim], *logs[spare]], took_over["step"])
    assert logs[spare][-1]["step"] == STEPS
    print(
        f"\none rank, SIGKILL: next step {took_over['t'] - killed:.2f} s after the kill, redone {redone};"
        f" incident: path {incident['path']}, {incident['time_to_resume_s']} s, {incident['steps_lost']} redone"
    )


def test_a_replacement_lost_before_its_own_first_snapshot_is_replaced_from_the_same_snapshot(tmp_path: Path) -> None:
    """A second fault inside the first K steps after a recovery: the restored rank has not committed a snapshot
    of its own yet, so the next replacement must find the one it restored from, not start the job afresh."""
    every = 20  # a long first window after the restore (20 steps of 0.05 s) so the second kill lands inside it
    with sim_node(tmp_path / "node", gpus=1) as node:
        run = launch_sharded(node, tmp_path, STEPS, "--spares", "2", every=every, step_sleep=0.05)
        run.wait_for("one rank past step 30", lambda ls: any(ln["step"] >= 30 for ln in ls))
        deadline = time.monotonic() + 90
        while not spare_warm():
            assert time.monotonic() < deadline, "no spare got warm in 90 s"
            time.sleep(0.1)
        first = run.steps()[-1]["pid"]
        os.kill(first, signal.SIGKILL)
        run.wait_for("the replacement's first step", lambda ls: any(ln["pid"] != first for ln in ls), 60)
        second = next(ln for ln in run.steps() if ln["pid"] != first)
        os.kill(second["pid"], signal.SIGKILL)
        own = [ln for ln in run.steps() if ln["pid"] == second["pid"]]
        run.wait_for("a third process's first step", lambda ls: len({ln["pid"] for ln in ls}) == 3, 60)
        third = next(ln for ln in run.steps() if ln["pid"] not in (first, second["pid"]))
        run.stop()
    assert all(ln["committed"] is None for ln in own), own  # the second kill came before its own first commit
    assert second["change"]["source"] == "memory" and third["change"]["source"] == "memory", (second, third)
    assert third["step"] == second["step"], (second["step"], third["step"])  # the same snapshot, nothing lost
