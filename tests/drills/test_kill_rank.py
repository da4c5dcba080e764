"""kill_rank against the sim daemon with a real (sleeping) process as the trainer rank, its report in the
runtime dir, and a stand-in for torchrun that starts the rank again after the kill."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatch.drills import injectors
from gpuwatch.drills.runner import DrillRefused, Request, prepare, run_drill
from tests.drills.conftest import ClientApi, Job, sim_clock
from tests.helpers import SimNode


def test_kill_rank_kills_the_rank_and_sees_the_job_come_back(node: SimNode, job: Job) -> None:
    victim = job.rank(gpu=1, rank=1)
    job.rank(gpu=0, rank=0)
    node.run_for(5)
    restarted: list[int] = []

    def torchrun() -> None:
        if not injectors.running(victim) and not restarted:
            restarted.append(job.rank(gpu=1, rank=1, step=11))

    run = prepare(Request("kill_rank", 1), ClientApi(node), node.daemon.config, sim_clock(node, hook=torchrun))
    assert run.victim is not None and run.victim.pid == victim
    verdict = run_drill(run)
    assert verdict.result == "pass", verdict.as_dict()
    assert [(s.name, s.result) for s in verdict.steps] == [
        ("kill", "pass"),
        ("rank_exited", "pass"),
        ("rank_gone", "pass"),
        ("job_resumed", "pass"),
    ]
    detail = verdict.steps[-1].detail
    assert detail.startswith("job job-7 resumed at step 10, ") and detail.endswith(
        " s after the fault began, 0 step(s) lost"
    )


def test_a_job_that_does_not_come_back_fails_at_job_resumed(node: SimNode, job: Job) -> None:
    job.rank(gpu=2, rank=0)
    node.run_for(5)
    config = node.daemon.config
    config = dataclasses.replace(config, drills=dataclasses.replace(config.drills, resume_timeout_s=20.0))
    verdict = run_drill(prepare(Request("kill_rank", 2), ClientApi(node), config, sim_clock(node)))
    assert verdict.broke_at == "job_resumed"
    assert verdict.steps[-1].detail == "not within 20 s: job job-7 has not come back (incident 1 is stopped)"


def test_kill_rank_picks_the_rank_asked_for_and_refuses_a_gpu_without_one(node: SimNode, job: Job) -> None:
    job.rank(gpu=3, rank=4)
    second = job.rank(gpu=3, rank=5)
    node.run_for(5)
    api, config, clock = ClientApi(node), node.daemon.config, sim_clock(node)
    assert prepare(Request("kill_rank", 3, rank=5), api, config, clock).victim.pid == second  # type: ignore[union-attr]
    with pytest.raises(DrillRefused, match=r"no rank 9 on GPU 3 \(trainers: rank 4 \(pid \d+\), rank 5"):
        prepare(Request("kill_rank", 3, rank=9), api, config, clock)
    with pytest.raises(DrillRefused, match=r"no trainer on GPU 0 \(trainers: none\)") as refused:
        prepare(Request("kill_rank", 0), api, config, clock)
    assert refused.value.reason == "no_trainer"
    assert all(injectors.running(c.pid) for c in job.children), "a refusal kills nothing"
