"""A standby spare has run the job's own set-up before the fault (CPU, gloo, sim daemon).

A user's loop (tests/spares/user_loop.py: a model with torch's default init, AdamW, a data index built
before the job object, `ShardedJob` with a host snapshot every K steps) runs under `gpuwatch launch
--in-place --spares 1`. The spare runs the same script at once and waits at its join; when a rank is lost
it takes the rank, restores the lost rank's host snapshot and steps. Measured from the loop's own log:
the next step comes within 3 s and sooner than the script's own set-up took in the same run, at most K
steps are redone and none is missing, the loss at every step equals an uninterrupted run's, and the
daemon's incident agrees with the log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.inplace.jobs import InPlaceRun, sim_node
from tests.spares.standby_runs import (
    fault_short_of_snapshot,
    kill_in_slow_step,
    launch_loop,
    losses,
    open_gate,
    rank_log,
    redone_and_missing,
    wait_for_standby,
    waiting_standbys,
)

pytestmark = pytest.mark.slow
K = 4
STEPS = 60  # the replacement runs for seconds: the daemon sees it step before the job ends
NEXT_STEP_S = 3.0
LOOP_ARGS = ("--steps", str(STEPS), "--every", str(K), "--step-sleep", "0.05", "--index-items", "3000000", "--checksum")
# A kill 1.5 s into a 3 s step after step 15 (one short of a snapshot): a guess from the last step's end and the
# step time would date the death about 1.4 s early; the launcher's exit note dates it within milliseconds.
SLOW_STEP, SLOW_S, INTO_S = 15, 3.0, 1.5
SLOW_ARGS = ("--slow-step", str(SLOW_STEP), "--slow-s", str(SLOW_S))


@contextlib.contextmanager
def _run(
    tmp: Path, gpus: int, launch_args: tuple[str, ...], *, gate: bool = True, loop_args: tuple[str, ...] = ()
) -> Iterator[tuple[DaemonProcess, InPlaceRun]]:
    with sim_node(tmp / "node", gpus=gpus) as node:
        if not gate:
            open_gate(tmp)
        run = launch_loop(node, tmp, launch_args, (*LOOP_ARGS, *loop_args))
        try:
            yield node, run
        finally:
            run.stop()


def _reference(tmp: Path, gpus: int, nproc: int) -> dict[tuple[int, int], set[float]]:
    """The losses of an uninterrupted run with the same seed (no spare, no fault)."""
    with _run(tmp, gpus, ("--nproc-per-node", str(nproc)), gate=False) as (_node, run):
        _, err = run.output(180)
        assert run.process.returncode == 0, err
        found = losses(run.steps())
    assert all(len(v) == 1 for v in found.values()) and len(found) == STEPS * nproc, found
    return found


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], set[float]]:
    return _reference(tmp_path_factory.mktemp("reference"), 1, 1)


def _resumed_incident(node: DaemonProcess, victim: int) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        found = [i for i in node.get("/v1/incidents")["incidents"] if victim in {r["pid"] for r in i["ranks"]}]
        if found and found[0]["status"] == "resumed":
            return dict(found[0])
        assert time.monotonic() < deadline, f"no resumed incident of pid {victim}: {found}"
        time.sleep(0.2)


def _recovered(
    tmp: Path, gpus: int, launch_args: tuple[str, ...], how: str, ranks: int = 1, rank: int = 0
) -> tuple[list[dict[str, Any]], dict[str, Any], str, int, float, int]:
    """Run the loop, fault `rank` once its standby waits at the join (`slow-kill`: SIGKILL in a slow step), let
    the job finish: its lines, the daemon's incident, the launcher's stderr, the victim, the fault's time and
    the standby's pid."""
    slow = how == "slow-kill"
    with _run(tmp, gpus, ("--spares", "1", *launch_args), loop_args=SLOW_ARGS if slow else ()) as (node, run):
        run.wait_for("every rank at the gate", lambda ls: len({ln["rank"] for ln in ls if ln["step"] >= 10}) == ranks)
        standby = wait_for_standby(run)
        open_gate(tmp)
        if slow:
            victim, at = kill_in_slow_step(run, SLOW_STEP, INTO_S)
        else:
            victim, at = fault_short_of_snapshot(run, rank, K, how)
        _, err = run.output(120)
        assert run.process.returncode == 0, err
        incident = _resumed_incident(node, victim)
    return run.steps(), incident, err, victim, at, standby


def _check(lines: list[dict[str, Any]], victim: int, at: float, standby: int, rank: int = 0) -> tuple[float, int]:
    """The standby took the lost rank, restored its host snapshot, stepped within 3 s and sooner than the
    script's own set-up took; at most K redone and none missing. The gap and the steps redone."""
    took_over = next(ln for ln in lines if ln["pid"] == standby)
    assert took_over["rank"] == rank and took_over["spare_warm_s"] is not None, took_over
    assert took_over["source"] == "memory", took_over  # the lost rank's host snapshot
    gap = min(ln["t"] for ln in lines if ln["t"] > at) - at
    setup_s = next(ln["setup_s"] for ln in lines if ln["pid"] == victim and "setup_s" in ln)
    assert gap <= NEXT_STEP_S and gap < setup_s, (gap, setup_s)
    redone, missing = redone_and_missing(rank_log(lines, rank))
    assert 0 <= redone <= K and not missing, (redone, missing)
    assert max(ln["step"] for ln in lines) == STEPS
    return gap, redone


def _exact(lines: list[dict[str, Any]], reference: dict[tuple[int, int], set[float]]) -> None:
    """Every loss the faulted run logged (a redone step's too) is the uninterrupted run's."""
    got = losses(lines)
    assert set(got) == set(reference), sorted(set(got) ^ set(reference))
    differ = {key: (got[key], reference[key]) for key in got if got[key] != reference[key]}
    assert not differ, differ


def test_a_killed_one_rank_loop_is_back_from_its_standby_sooner_than_its_own_set_up(
    tmp_path: Path, one_rank_reference: dict[tuple[int, int], set[float]]
) -> None:
    """Killed in a slow step: the incident's onset is the kill's (the launcher's exit note), not a step-time guess."""
    lines, incident, err, victim, at, standby = _recovered(tmp_path, 1, (), "slow-kill")
    gap, redone = _check(lines, victim, at, standby)
    _exact(lines, one_rank_reference)
    assert "a standby at the job's join" in err, err
    assert incident["path"] == "spare" and incident["spare_stage"] == "standby", incident
    assert abs(incident["began_t"] - at) <= 0.5, (incident["began_t"] - at, incident)
    assert abs(incident["time_to_resume_s"] - gap) <= 0.5 and incident["steps_lost"] == redone, (incident, gap, redone)
    print(f"\none rank, SIGKILL in a slow step: next step {gap:.2f} s, redone {redone}; incident"
          f" {incident['time_to_resume_s']} s, onset {incident['began_t'] - at:+.3f} s from the kill")  # fmt: skip


def test_on_a_node_of_8_gpus_the_standby_takes_the_rank_not_a_cold_worker_elsewhere(
    tmp_path: Path, one_rank_reference: dict[tuple[int, int], set[float]]
) -> None:
    lines, incident, err, victim, at, standby = _recovered(tmp_path, 8, ("--nproc-per-node", "1"), "kill")
    gap, redone = _check(lines, victim, at, standby)
    _exact(lines, one_rank_reference)
    assert "usable: a rank joins" not in err and "a standby at the job's join" in err, err
    assert len({ln["pid"] for ln in lines}) == 2, lines  # the victim and its standby: no other worker
    assert abs(incident["time_to_resume_s"] - gap) <= 0.5 and incident["steps_lost"] == redone, (incident, gap, redone)


def test_a_frozen_rank_killed_after_its_hang_is_replaced_exactly(
    tmp_path: Path, one_rank_reference: dict[tuple[int, int], set[float]]
) -> None:
    lines, _incident, _err, victim, at, standby = _recovered(tmp_path, 1, (), "stop")
    _check(lines, victim, at + 1.0, standby)  # from the SIGKILL, 1 s after the SIGSTOP
    _exact(lines, one_rank_reference)


def test_a_second_fault_before_the_next_standby_is_ready_takes_the_best_that_is_ready(
    tmp_path: Path, one_rank_reference: dict[tuple[int, int], set[float]]
) -> None:
    """The standby that took the rank is lost at once, while the spare started behind it is still importing
    torch or running the set-up: that spare takes the rank all the same (the launcher's line says how far it
    was), not a cold start, and the job still finishes with every step and the uninterrupted run's losses."""
    with _run(tmp_path, 1, ("--spares", "1")) as (node, run):
        run.wait_for("the rank at the gate", lambda ls: any(ln["step"] >= 10 for ln in ls))
        standby = wait_for_standby(run)
        open_gate(tmp_path)
        fault_short_of_snapshot(run, 0, K)
        run.wait_for("the standby's first step", lambda ls: any(ln["pid"] == standby for ln in ls), 60)
        time.sleep(1.5)  # the daemon lists the new rank (a 1 s sample) before it is lost in turn
        assert not waiting_standbys(run)  # the next one is not at the join yet
        os.kill(standby, signal.SIGKILL)
        run.wait_for("a third process's step", lambda ls: len({ln["pid"] for ln in ls}) == 3, 120)
        _, err = run.output(120)
        second = _resumed_incident(node, standby)  # the job's newest incident: the daemon awaits that one
    assert run.process.returncode == 0, err
    lines = run.steps()
    took = [line for line in err.splitlines() if "takes n0.g0." in line]
    assert len(took) == 2 and "a standby at the job's join" in took[0], took
    assert "still starting" in took[1] or "warm, without the job's set-up" in took[1], took
    assert second["path"] == "spare" and second["spare_stage"] in ("warm", "starting"), second
    _, missing = redone_and_missing(rank_log(lines, 0))
    assert not missing and max(ln["step"] for ln in lines) == STEPS
    _exact(lines, one_rank_reference)


def test_a_three_rank_sharded_job_comes_back_through_the_standby_with_the_state_it_saved(tmp_path: Path) -> None:
    """Every rank rolls back to the snapshot and the standby restores the lost rank's: the loss at every step, on
    every rank (a redone step's too), equals the uninterrupted run's, and the replicas agree at every step after.

    With three ranks the gradient all-reduce's sum depends on its bucket layout: a generation's new
    DistributedDataParallel must reduce its first step in the layout an uninterrupted run uses there."""
    reference = _reference(tmp_path / "reference", 3, 3)
    lines, incident, _err, victim, at, standby = _recovered(tmp_path / "faulted", 3, (), "kill", ranks=3, rank=1)
    _check(lines, victim, at, standby, rank=1)
    _exact(lines, reference)
    resumed = next(ln["step"] for ln in lines if ln["pid"] == standby)
    assert max(step for step, _rank in reference) >= resumed + 2 * K  # steps after the recovery were compared
    generation = next(ln["generation"] for ln in lines if ln["pid"] == standby)
    for step in range(resumed, STEPS + 1):  # a survivor may log the step the kill interrupted, then roll back
        sums = {ln["checksum"] for ln in lines if ln["step"] == step and ln["generation"] >= generation}
        assert len(sums) == 1, (step, sums)  # every rank holds the same parameters
    assert incident["path"] == "spare", incident


def test_the_standby_holds_no_rank_and_no_connection_before_the_hand_over(tmp_path: Path) -> None:
    """While the standby waits at the join the job steps in its first generation alone: the standby has no
    RANK, no socket open (the job's store, gloo and the daemon are all reached through one) and no member id."""
    with _run(tmp_path, 2, ("--spares", "1")) as (_node, run):
        run.wait_for("both ranks at the gate", lambda ls: len({ln["rank"] for ln in ls if ln["step"] >= 10}) == 2)
        standby = wait_for_standby(run)
        open_gate(tmp_path)
        run.wait_for("step 30", lambda ls: any(ln["step"] >= 30 for ln in ls))
        assert waiting_standbys(run) == [standby]
        environ = Path(f"/proc/{standby}/environ").read_bytes().split(b"\0")
        assert not any(item.startswith((b"RANK=", b"GPUWATCH_INPLACE_MEMBER=")) for item in environ)
        assert _sockets(standby) == [], _sockets(standby)
        assert {ln["generation"] for ln in run.steps()} == {1}  # nobody joined nor left
        _, err = run.output(120)
    assert run.process.returncode == 0, err


def _sockets(pid: int) -> list[str]:
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = fd.readlink()
            if str(target).startswith("socket:"):
                found.append(str(target))
    return found


def test_the_sockets_helper_sees_a_socket() -> None:
    with socket.socket() as s:
        assert f"socket:[{os.fstat(s.fileno()).st_ino}]" in _sockets(os.getpid())
