"""Remediation on sudden faults (issue 9) in a sim daemon, with real processes as ranks.

A rank that vanishes, raises, loses its GPU or hangs: the rest of its job on this node is stopped
at once, the incident names what happened, and the relaunch is seen however short it is (issue 16).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SimNode, start_sim_node, wait_for
from tests.remediation.conftest import Spawn

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimNode]:
    node = start_sim_node(
        tmp_path,
        gpus=4,
        **{
            "trainer.grace_period_s": 5.0,
            "trainer.kill_after_s": 0.5,
            "trainer.stale_after_s": 8.0,
            "trainer.hang_after_s": 12.0,
        },
    )
    yield node
    node.close()


def incident_with(sim: SimNode, **want: Any) -> dict[str, Any]:
    def match() -> dict[str, Any] | None:
        return next((i for i in sim.incidents() if all(i.get(k) == v for k, v in want.items())), None)

    return dict(wait_for(match))


def two_ranks(sim: SimNode, spawn: Spawn, step: int = 40) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    rank0, rank1 = spawn(), spawn()
    sim.report(rank0, 0, rank=0, step=step, first_step=1)
    sim.report(rank1, 1, rank=1, step=step, first_step=1)
    sim.run_for(1, step=1)  # one publish: remediation now knows both ranks
    return rank0, rank1


def test_a_rank_that_vanishes_stops_its_peers_at_once_and_the_resume_loses_no_step(sim: SimNode, spawn: Spawn) -> None:
    rank0, rank1 = two_ranks(sim, spawn)
    died_at = sim.clock.t

    rank1.kill()  # SIGKILL: its report stays with `ended` null
    # No tick runs from here on (the fake clock stands still): the exit alone must start the stop.
    incident = incident_with(sim, kind="rank_died", status="stopped")

    assert rank0.wait(5) == 75  # the stop signal reached the survivor
    assert (incident["cause"], incident["gpu"], incident["job"], incident["last_step"]) == ("rank_died", 1, "job", 40)
    assert {r["pid"]: r["ended"] for r in incident["ranks"]} == {rank1.pid: "died", rank0.pid: "exited"}
    assert incident["t"] == died_at

    # The relaunch: the survivor saved step 40, the new ranks start at step 41.
    relaunched = spawn()
    sim.report(relaunched, 0, rank=0, step=41, first_step=41, t=died_at + 6.0)
    incident = incident_with(sim, kind="rank_died", status="resumed")
    assert (incident["resumed_step"], incident["steps_lost"], incident["time_to_resume_s"]) == (40, 0, 6.0)


def test_a_rank_that_raised_is_a_death_and_a_clean_end_is_not(sim: SimNode, spawn: Spawn) -> None:
    rank0, rank1 = two_ranks(sim, spawn)

    sim.report(rank0, 0, rank=0, step=40, first_step=1, ended="finished")
    rank0.kill()
    time.sleep(0.5)
    assert sim.incidents() == [], "a rank whose last report says it finished ended cleanly"

    sim.report(rank1, 1, rank=1, step=40, first_step=1, ended="error")
    rank1.kill()
    incident = incident_with(sim, kind="rank_died")
    assert {r["pid"]: r["ended"] for r in incident["ranks"]} == {rank1.pid: "raised"}


def test_an_xid_on_a_gpu_with_ranks_stops_the_job_as_a_gpu_fault(sim: SimNode, spawn: Spawn) -> None:
    rank0, rank1 = two_ranks(sim, spawn)

    sim.daemon.monitor.inject(1, {}, 60.0, event="xid", xid=31)  # an application XID: no quarantine

    incident = incident_with(sim, kind="gpu_fault", status="stopped")
    assert incident["gpu"] == 1 and "31" in incident["reason"]
    assert rank0.wait(5) == 75 and rank1.wait(5) == 75
    assert not sim.gpu(1)["quarantined"], "XID 31 does not condemn the card"

    # The relaunch runs on the same GPU while the old XID is still in its window: not stopped again.
    again = spawn()
    sim.report(again, 1, rank=1, step=41, first_step=41, t=sim.clock.t + 1)
    sim.run_for(3, step=1)
    time.sleep(0.5)
    assert again.poll() is None and len(sim.incidents()) == 1
    # A new XID on it is a new fault.
    sim.daemon.monitor.inject(1, {}, 60.0, event="xid", xid=31)
    wait_for(lambda: len(sim.incidents()) == 2)
    assert again.wait(5) == 75


def test_a_hung_job_is_found_and_stopped(sim: SimNode, spawn: Spawn) -> None:
    rank0, rank1 = two_ranks(sim, spawn)
    os.kill(rank1.pid, signal.SIGSTOP)  # frozen: it stops reporting; rank 0 waits in a collective

    for _ in range(10):  # rank 0's link still reports, always at step 40
        sim.clock.advance(2.0)
        sim.report(rank0, 0, rank=0, step=40, first_step=1)
        sim.daemon.monitor.tick()

    incident = incident_with(sim, kind="trainer_hang", status="stopped")
    assert (
        "no rank got past step 40" in incident["reason"]
        and "rank 1 of job job is stopped (SIGSTOP)" in incident["reason"]
    )
    assert rank0.wait(5) == 75
    assert rank1.wait(5) == -signal.SIGKILL, "a stopped rank cannot checkpoint: SIGKILL once its peers are gone"


def test_a_resume_that_finished_before_the_next_report_interval_is_seen(sim: SimNode, spawn: Spawn) -> None:
    rank0, rank1 = two_ranks(sim, spawn)
    response = sim.client.post("/v1/gpus/1/quarantine", json={"reason": "test"}, headers=sim.auth)
    assert response.status_code == 200
    incident_with(sim, status="stopped")
    decided = sim.incidents()[0]["t"]

    # A whole relaunch between two polls: first report at its first step, last report at exit, gone.
    short = spawn()
    sim.report(short, 0, rank=0, step=45, first_step=41, ended="finished", t=decided + 2.5)
    short.kill()
    short.wait()

    incident = incident_with(sim, status="resumed")
    assert (incident["resumed_step"], incident["steps_lost"], incident["time_to_resume_s"]) == (40, 0, 2.5)


def test_a_bad_report_beside_good_ones_never_turns_stopping_off(sim: SimNode, spawn: Spawn) -> None:
    rank0 = spawn()
    sim.report(rank0, 1, rank=0, step=10)
    liar = spawn()
    sim.report(liar, 1, rank=1, step=10, step_time_s="abc")  # one user's badly typed report
    sim.run_for(1, step=1)

    sim.client.post("/v1/gpus/1/quarantine", json={"reason": "test"}, headers=sim.auth)

    incident = incident_with(sim, status="stopped")
    assert [r["pid"] for r in incident["ranks"]] == [rank0.pid]
    assert liar.poll() is None, "a rank whose report was rejected is never signalled on its word"


@pytest.mark.slow
def test_quarantine_release_cycles_leave_no_threads(tmp_path: Path, spawn: Spawn) -> None:
    """100 cycles with a rank that ignores the stop: one remediation thread, whatever happens."""
    sim = start_sim_node(tmp_path, gpus=2, **{"trainer.grace_period_s": 3600.0})
    try:
        stubborn = spawn("ignores_stop")
        sim.report(stubborn, 1, rank=0, step=1)
        sim.run_for(1, step=1)

        def cycle() -> None:
            assert sim.client.post("/v1/gpus/1/quarantine", json={"reason": "c"}, headers=sim.auth).status_code == 200
            assert sim.client.post("/v1/gpus/1/release", json={"reason": "c"}, headers=sim.auth).status_code == 200

        def ours() -> list[str]:
            """The daemon's own threads (the test client's and anyio's worker threads come and go)."""
            return sorted(t.name for t in threading.enumerate() if t.name.startswith("gpuwatch-"))

        before = ours()
        for _ in range(100):
            cycle()
        wait_for(lambda: len(sim.incidents()) == 100)
        assert ours() == before
        assert before.count("gpuwatch-remediation") == 1
        assert stubborn.poll() is None
    finally:
        sim.close()


@pytest.mark.parametrize("how", ["quarantine", "xid"])
def test_a_rank_that_started_after_the_last_tick_is_stopped_too(sim: SimNode, spawn: Spawn, how: str) -> None:
    """An event or a quarantine reads the reports as they are now: no waiting for the next tick (30 s by default)."""
    sim.run_for(1, step=1)
    rank = spawn()
    sim.report(rank, 1, rank=0, step=3, first_step=1)  # sent after the last tick read the reports

    if how == "quarantine":
        sim.client.post("/v1/gpus/1/quarantine", json={"reason": "test"}, headers=sim.auth)
    else:
        sim.daemon.monitor.inject(1, {}, 60.0, event="xid", xid=79)

    incident = incident_with(sim, status="stopped")
    assert [r["pid"] for r in incident["ranks"]] == [rank.pid] and incident["job"] == "job"
    assert rank.wait(5) == 75


def test_a_rank_killed_before_any_publish_listed_it_still_leaves_an_incident(sim: SimNode, spawn: Spawn) -> None:
    """A replacement killed within a second of its first step, before the daemon's next sample listed it: its
    report (no end said, its process gone) is all the daemon has, and it is a death like one seen."""
    sim.run_for(1, step=1)  # a publish before it: the node runs
    rank = spawn()
    sim.report(rank, 1, rank=0, step=3, first_step=1)
    rank.kill()  # no tick from here on: no publish lists it
    incident = incident_with(sim, kind="rank_died")
    assert [r["pid"] for r in incident["ranks"]] == [rank.pid] and incident["job"] == "job", incident
    assert incident["ranks"][0]["ended"] == "died" and incident["last_step"] == 3, incident
