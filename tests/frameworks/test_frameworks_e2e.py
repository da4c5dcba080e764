"""HF Trainer and Lightning under `gpuwatch launch` with only gpuwatch's one line: 2 gloo ranks, the sim daemon.

A tiny GPT-2 checkpoints every 50 steps; the fault strikes past step 70. Without gpuwatch's
callback the job resumes from the checkpoint of step 50 and loses 20 steps or more; with it the
stop (a quarantine) or the survivor's rescue (a SIGKILL of the other rank) saves the step the job
was at, and the framework's own resume goes on from there: 0 steps lost in the job's own log, and
the daemon's incident says the same. A torn newest checkpoint is passed over with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks import jobs
from tests.frameworks.jobs import Node, StepLog

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

ARGS = ("--steps", "110", "--save-steps", "50", "--step-sleep", "0.05")
SCRIPTS = {"hf": "hf_train.py", "lightning": "lightning_train.py"}
RESCUED = {"hf": "gpuwatch: rescued checkpoint-", "lightning": "gpuwatch: rescued last-gpuwatch-rank0.ckpt"}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with Node(tmp_path) as daemon:
        yield daemon


def _strike_past_step_70(
    node: Node, framework: str, out: Path, strike: Callable[[Node, list[dict[str, Any]]], None]
) -> tuple[StepLog, str]:
    proc = jobs.launch(node, SCRIPTS[framework], out, *ARGS)
    ranks = jobs.wait_for_step(node, proc, 70)
    strike(node, ranks)
    _, stderr = jobs.finish(proc)
    return StepLog.read(Path(f"{out}.log.rank0")), stderr


FAULTS = {  # what strikes past step 70, and the kind of incident the daemon opens for it
    "quarantine": (lambda node, _: jobs.quarantine(node, 1), "quarantine"),
    "sigkill": (lambda _, ranks: jobs.kill_rank(ranks, 1), "rank_died"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_a_quarantine_or_a_killed_rank_loses_no_step(node: Node, tmp_path: Path, framework: str, fault: str) -> None:
    strike, kind = FAULTS[fault]
    log, stderr = _strike_past_step_70(node, framework, tmp_path / "out", strike)

    assert len(log.launches) == 2 and log.launches[1][-1] == 110, stderr[-3000:]
    assert log.resumed_from > 70 and log.lost() == 0, (log.resumed_from, log.furthest)
    if fault == "sigkill":  # the survivor saved the step it was at
        assert RESCUED[framework] in stderr, stderr[-3000:]
    incident = jobs.incident(node)
    assert incident["kind"] == kind and incident["steps_lost"] == log.lost() == 0, incident
    assert incident["resumed_step"] == log.resumed_from
    print(
        f"\n{framework}, {fault} past step 70: resumed from step {log.resumed_from}, 0 lost; "
        f"stop {incident['time_to_stop_s']} s, first resumed step {incident['time_to_resume_s']} s after the fault"
    )


@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_after_a_killed_rank_and_the_resume_every_logged_loss_equals_an_uninterrupted_runs(
    node: Node, tmp_path: Path, framework: str
) -> None:
    _, plain_stderr = jobs.finish(jobs.launch(node, SCRIPTS[framework], tmp_path / "plain", *ARGS))
    plain = StepLog.read(tmp_path / "plain.log.rank0")
    assert len(plain.launches) == 1, plain_stderr[-3000:]  # uninterrupted: one launch (a relaunch trains past 110)
    log, stderr = _strike_past_step_70(node, framework, tmp_path / "out", FAULTS["sigkill"][0])

    assert log.lost() == 0 and log.launches[1][-1] == 110, stderr[-3000:]
    assert sorted(plain.losses) == list(range(1, 111))
    # HF logs a step's loss after its step-end callbacks, where the survivor's rescue saves that step and
    # ends the run: the rescued step may have no loss line of its own (it is not redone). No other may lack one.
    assert set(plain.losses) - set(log.losses) <= {log.resumed_from}, (log.resumed_from, sorted(log.losses))
    differ = {s: (log.losses[s], plain.losses[s]) for s in log.losses if log.losses[s] != plain.losses[s]}
    assert not differ, f"resumed from step {log.resumed_from}; losses that differ: {differ}"
    print(f"\n{framework}: resumed from step {log.resumed_from}; every loss equals the uninterrupted run's")


@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_ranks_that_wait_for_a_slow_save_on_rank_0_are_no_hang(tmp_path: Path, framework: str) -> None:
    """The framework's save is declared a pause: with the daemon's frozen-rank limit at 3 s, rank 0 takes 8 s
    longer for its save at step 20 while rank 1 waits in a barrier; the job is neither stopped nor relaunched."""
    with Node(tmp_path, GPUWATCH_TRAINER_HANG_FROZEN_AFTER_S="3") as node:
        out = tmp_path / "out"
        args = ("--steps", "30", "--save-steps", "20", "--step-sleep", "0.05", "--save-sleep", "8")
        _, stderr = jobs.finish(jobs.launch(node, SCRIPTS[framework], out, *args))
        hangs = [i for i in node.get("/v1/incidents")["incidents"] if i["kind"] == "trainer_hang"]

    log = StepLog.read(Path(f"{out}.log.rank0"))
    assert not hangs, hangs
    assert log.launches == [list(range(1, 31))], stderr[-3000:]


def _tear_hf(out: Path) -> list[str]:
    model = out / "checkpoint-60" / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # cut in half: plain HF crashes on it
    (out / "checkpoint-40" / "optimizer.pt").unlink()  # plain HF would resume with a fresh AdamW state
    return [
        "skipped checkpoint checkpoint-60: size mismatch for model.safetensors",
        "skipped checkpoint checkpoint-40: missing optimizer.pt",
    ]


def _tear_lightning(out: Path) -> list[str]:
    last = out / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    (out / "epoch=0-step=60.ckpt.manifest.json").unlink()  # as if the save had died before its seal
    return [
        "skipped checkpoint last.ckpt: size mismatch for last.ckpt",
        "skipped checkpoint epoch=0-step=60.ckpt: no epoch=0-step=60.ckpt.manifest.json: not sealed",
    ]


@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_a_torn_newest_checkpoint_is_passed_over_with_its_reason(node: Node, tmp_path: Path, framework: str) -> None:
    out = tmp_path / "out"
    jobs.finish(jobs.launch(node, SCRIPTS[framework], out, "--steps", "60", "--save-steps", "20"))
    expected = {"hf": _tear_hf, "lightning": _tear_lightning}[framework](out)

    _, stderr = jobs.finish(jobs.launch(node, SCRIPTS[framework], out, "--steps", "70", "--save-steps", "20"))

    for line in expected:
        assert line in stderr, stderr[-3000:]
    log = StepLog.read(Path(f"{out}.log.rank0"))
    assert log.resumed_from == {"hf": 20, "lightning": 40}[framework]
    assert log.launches[1][-1] == 70
