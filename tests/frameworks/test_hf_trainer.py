"""Hugging Face Trainer under `gpuwatch launch` with only `callbacks=[GpuwatchCallback()]`: 2 gloo ranks, sim daemon.

A tiny GPT-2 checkpoints every 50 steps; the fault strikes past step 70. Without gpuwatch's
callback the job resumes from checkpoint-50 and loses 20+ steps; with it the stop (a quarantine)
or the survivor's rescue (a SIGKILL of the other rank) saves the step the job was at, and HF's own
resume goes on from there: 0 steps lost in the job's own log, and the daemon's incident says the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.frameworks import jobs
from tests.frameworks.jobs import Node, StepLog

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ARGS = ("--steps", "110", "--save-steps", "50", "--step-sleep", "0.05")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with Node(tmp_path) as daemon:
        yield daemon


def _strike_past_step_70(node: Node, out: Path, strike: Callable[[Node, list[dict]], None]) -> tuple[StepLog, str]:
    proc = jobs.launch(node, "hf_train.py", out, *ARGS)
    ranks = jobs.wait_for_step(node, proc, 70)
    strike(node, ranks)
    _, stderr = jobs.finish(proc)
    return StepLog.read(Path(f"{out}.log.rank0")), stderr


def test_a_quarantine_loses_no_step(node: Node, tmp_path: Path) -> None:
    log, stderr = _strike_past_step_70(node, tmp_path / "out", lambda node, ranks: jobs.quarantine(node, 1))

    assert len(log.launches) == 2, stderr[-3000:]
    assert log.resumed_from > 70 and log.lost() == 0, (log.resumed_from, log.launches[0][-1])
    assert log.launches[1][-1][0] == 110
    incident = jobs.incident(node)
    assert incident["kind"] == "quarantine" and incident["steps_lost"] == log.lost() == 0
    assert incident["resumed_step"] == log.resumed_from
    print(
        f"\nHF Trainer, quarantine past step 70: resumed from step {log.resumed_from}, 0 lost; "
        f"stop {incident['time_to_stop_s']:.2f} s, resume {incident['time_to_resume_s']:.2f} s"
    )


def test_a_killed_rank_is_rescued_by_its_peer_and_loses_no_step(node: Node, tmp_path: Path) -> None:
    log, stderr = _strike_past_step_70(node, tmp_path / "out", lambda node, ranks: jobs.kill_rank(ranks, 1))

    assert "rescued checkpoint-" in stderr, stderr[-3000:]
    assert len(log.launches) == 2 and log.resumed_from > 70 and log.lost() == 0, log.launches[0][-1]
    incident = jobs.incident(node)
    assert incident["kind"] == "rank_died" and incident["steps_lost"] == log.lost() == 0, incident
    assert incident["resumed_step"] == log.resumed_from
    print(
        f"\nHF Trainer, SIGKILL of rank 1 past step 70: rescued step {log.resumed_from}, 0 lost; "
        f"resume {incident['time_to_resume_s']:.2f} s"
    )


def test_a_torn_newest_checkpoint_is_set_aside_with_its_reason_and_hf_resumes_from_a_good_one(
    node: Node, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    jobs.finish(jobs.launch(node, "hf_train.py", out, "--steps", "60", "--save-steps", "20"))
    model = out / "checkpoint-60" / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # cut in half
    (out / "checkpoint-40" / "optimizer.pt").unlink()  # plain HF would resume with a fresh AdamW state

    _, stderr = jobs.finish(jobs.launch(node, "hf_train.py", out, "--steps", "70", "--save-steps", "20"))

    assert "skipped checkpoint checkpoint-60: size mismatch for model.safetensors" in stderr, stderr[-3000:]
    assert "skipped checkpoint checkpoint-40: missing optimizer.pt" in stderr
    log = StepLog.read(Path(f"{out}.log.rank0"))
    assert log.resumed_from == 20 and log.launches[1][-1][0] == 70
    assert not (out / "checkpoint-60").exists() and sorted(p.name for p in out.glob(".unverified-*"))
