"""hang_rank, fault_rank, and kill_rank's fast failure, against the sim daemon with real processes as ranks."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.drills import injectors
from gpuwatch.drills.runner import DrillRefused, Request, prepare, run_drill
from tests.drills.conftest import ClientApi, Job, sim_clock, start_drill_node
from tests.helpers import SimNode

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

WORKER = """
import json, os, sys, time
from pathlib import Path
from gpuwatch.trainer.channel import ReportSender
report = {"t": float(sys.argv[3]), "pid": os.getpid(), "rank": 0, "job_id": "job-7", "gpu_uuid": sys.argv[2]}
report["step"] = 10
assert ReportSender(Path(sys.argv[1]), None).send(json.dumps(report).encode(), final=True)
print(os.getpid(), flush=True)
time.sleep(120)
"""
TORCHRUN_STAND_IN = (
    "# torch.distributed.run stand-in: runs one worker (which reports), exits when it does\n"
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]); "
    "sys.exit(p.wait() and 1)"
)


@pytest.fixture
def hang_node(tmp_path: Path) -> Iterator[SimNode]:
    overrides = {"trainer.hang_after_s": 10.0, "trainer.stale_after_s": 5.0, "trainer.grace_period_s": 2.0}
    node = start_drill_node(tmp_path, **overrides)
    yield node
    node.close()


def test_kill_rank_fails_at_once_when_nothing_will_relaunch_the_job(node: SimNode, job: Job) -> None:
    socket_path = str(node.daemon.runtime.socket_path)
    args = [WORKER, socket_path, node.gpu(1)["uuid"], str(node.clock.t)]
    torchrun = subprocess.Popen([sys.executable, "-c", TORCHRUN_STAND_IN, *args], stdout=subprocess.PIPE, text=True)
    job._adopt(torchrun)
    assert torchrun.stdout is not None
    int(torchrun.stdout.readline())  # the worker's pid, once its report is sent
    node.run_for(5)

    verdict = run_drill(prepare(Request("kill_rank", 1), ClientApi(node), node.daemon.config, sim_clock(node)))

    assert verdict.broke_at == "job_resumed"
    last = verdict.steps[-1]
    assert last.detail == f"torchrun (pid {torchrun.pid}) exited: nothing will relaunch job job-7"
    assert last.duration_s < 5.0, "the drill must not wait out its 300 s deadline"


def test_hang_rank_freezes_a_rank_the_daemon_finds_the_hang_and_the_job_comes_back(hang_node: SimNode) -> None:
    job = Job(hang_node)
    try:
        waiting = job.rank(gpu=0, rank=0)
        victim = job.rank(gpu=1, rank=1)
        hang_node.run_for(5)
        relaunched: list[int] = []

        def world() -> None:
            """Rank 0 waits in a collective (its link still reports step 10); torchrun relaunches when both are gone."""
            if injectors.running(waiting):
                job.report(waiting, 0, 0, 10)
            elif not injectors.running(victim) and not relaunched:
                relaunched.append(job.rank(gpu=0, rank=0, step=11))
            elif relaunched:
                job.report(relaunched[0], 0, 0, 11)

        run = prepare(
            Request("hang_rank", 1), ClientApi(hang_node), hang_node.daemon.config, sim_clock(hang_node, hook=world)
        )
        verdict = run_drill(run)

        assert verdict.result == "pass", verdict.as_dict()
        assert [s.name for s in verdict.steps] == ["freeze", "hang_found", "job_resumed", "thaw"]
        assert "no rank got past step 10" in verdict.steps[1].detail
        assert verdict.steps[2].detail.startswith("job job-7 resumed at step 10,")
        assert verdict.steps[3].detail == f"pid {victim} is gone (the daemon stopped it)"
    finally:
        job.stop()


def test_fault_rank_signals_only_a_rank_that_opted_in(node: SimNode, job: Job) -> None:
    job.rank(gpu=2, rank=0)
    opted = job.rank(gpu=3, rank=0, handler="signal.signal(signal.SIGUSR2, lambda *_: os._exit(1))", allow_drills=True)
    node.run_for(5)
    api, config = ClientApi(node), node.daemon.config
    with pytest.raises(DrillRefused, match=r"did not opt in to drills: TrainerLink\(allow_drills=True\)"):
        prepare(Request("fault_rank", 2), api, config, sim_clock(node))

    relaunched: list[int] = []

    def torchrun() -> None:
        if not injectors.running(opted) and not relaunched:
            relaunched.append(job.rank(gpu=3, rank=0, step=11))

    verdict = run_drill(prepare(Request("fault_rank", 3), api, config, sim_clock(node, hook=torchrun)))

    assert verdict.result == "pass", verdict.as_dict()
    assert [(s.name, s.detail.split(":")[0]) for s in verdict.steps][:2] == [
        ("fault", f"sent SIGUSR2 to pid {opted}"),
        ("rank_exited", f"pid {opted} exited"),
    ]
