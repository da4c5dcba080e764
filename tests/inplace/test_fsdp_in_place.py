"""FSDP2 jobs recover in place through a warm spare (CPU, gloo, sim daemon, 4 ranks).

`gpuwatch launch --in-place --spares 1` runs gpuwatch.examples.fsdp_worker (`fully_shard`, AdamW; with
--tp 2 a 2x2 mesh, FSDP x tensor parallel). Rank 2 is SIGKILLed (or frozen, then killed as the
daemon's hang rule would): the survivors keep their processes, a spare takes rank 2's place, the
process group and the mesh are formed anew and the model rebuilt on them, and every rank loads its
own shards of the newest step all ranks hold in host memory. Each rank's own log shows its next step
within 3 s of the kill, at most K steps redone and none missing, and the loss and this rank's shard
checksum at every step after the kill equal to an uninterrupted run's with the same seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.inplace.jobs import InPlaceRun, by_pid, check_rank_log, kill_when_warm, launch_fsdp, post, sim_node

pytestmark = pytest.mark.slow
K = 3
NEXT_STEP_S = 3.0
STEPS = 150
RANKS = 4
GROWN_STEPS = 400  # the shrink test's: long enough for the released GPU's new rank (a cold start) to join


def _uninterrupted(tmp: Path, tp: int) -> dict[tuple[int, int], tuple[float, str]]:
    """(step, rank) -> (loss, checksum) of a run with no fault."""
    with sim_node(tmp / "node", gpus=RANKS) as node:
        run = launch_fsdp(node, tmp, STEPS, every=K, tp=tp, step_sleep=0.0)
        out, err = run.output(180)
    assert run.process.returncode == 0, err
    return {(ln["step"], ln["rank"]): (ln["loss"], ln["checksum"]) for ln in run.steps()}


@pytest.fixture(scope="module")
def reference_1d(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], tuple[float, str]]:
    return _uninterrupted(tmp_path_factory.mktemp("reference_1d"), tp=1)


def _killed_run(tmp_path: Path, tp: int, freeze_s: float = 0.0) -> tuple[InPlaceRun, int, float]:
    with sim_node(tmp_path / "node", gpus=RANKS) as node:
        run = launch_fsdp(node, tmp_path, STEPS, "--spares", "1", every=K, tp=tp)
        victim, killed = kill_when_warm(run, RANKS, rank=2, every=K, past=15, freeze_s=freeze_s, start_s=300)
        out, err = run.output(120)
    assert run.process.returncode == 0, err
    assert "a spare (pid" in err, err
    return run, victim, killed


def _check(run: InPlaceRun, victim: int, killed: float, reference: dict[tuple[int, int], tuple[float, str]]) -> str:
    lines = run.steps()
    logs = by_pid(lines)
    survivors = sorted(pid for pid in logs if pid != victim and any(ln["t"] < killed for ln in logs[pid]))
    (spare,) = [pid for pid in logs if pid not in (*survivors, victim)]
    assert len(survivors) == RANKS - 1, survivors
    assert all(logs[pid][-1]["step"] == STEPS for pid in survivors)  # the same processes, to the end
    took_over: dict[str, Any] = logs[spare][0]
    assert took_over["rank"] == 2 and took_over["change"]["source"] == "memory", took_over  # its host snapshot
    gone_from = logs[victim][-1]["generation"]  # the first step of a later generation: the job's recovery
    first = min((ln for ln in lines if ln["generation"] > gone_from), key=lambda ln: ln["t"])
    assert first["t"] - killed <= NEXT_STEP_S, first["t"] - killed
    resumed = took_over["step"]
    redone = {pid: check_rank_log(logs[pid], resumed, K) for pid in survivors}
    redone[victim] = check_rank_log([*logs[victim], *logs[spare]], resumed, K)
    after = [ln for ln in lines if ln["step"] >= resumed and ln["t"] > killed]
    assert len(after) >= RANKS * (STEPS - resumed + 1), len(after)
    for line in after:  # what an uninterrupted run computed at this step on this rank
        assert (line["loss"], line["checksum"]) == reference[(line["step"], line["rank"])], line
    return (
        f"next step {first['t'] - killed:.2f} s after the kill, resumed at {resumed}, redone {sorted(redone.values())}"
    )


def test_a_killed_fsdp_rank_is_replaced_and_the_loss_goes_on_as_without_the_fault(
    tmp_path: Path, reference_1d: dict[tuple[int, int], tuple[float, str]]
) -> None:
    run, victim, killed = _killed_run(tmp_path, tp=1)
    print(f"\nFSDP2, 4 ranks, SIGKILL of rank 2: {_check(run, victim, killed, reference_1d)}")


def test_a_frozen_fsdp_rank_killed_is_replaced_and_the_loss_goes_on_as_without_the_fault(
    tmp_path: Path, reference_1d: dict[tuple[int, int], tuple[float, str]]
) -> None:
    run, victim, killed = _killed_run(tmp_path, tp=1, freeze_s=1.0)
    print(f"\nFSDP2, 4 ranks, rank 2 frozen 1 s then killed: {_check(run, victim, killed, reference_1d)}")


def test_a_killed_rank_of_a_2x2_mesh_is_replaced_in_its_place_on_both_dimensions(tmp_path: Path) -> None:
    reference = _uninterrupted(tmp_path / "reference", tp=2)
    run, victim, killed = _killed_run(tmp_path / "job", tp=2)
    print(f"\nFSDP2 x TP 2x2, SIGKILL of rank 2: {_check(run, victim, killed, reference)}")


def test_a_quarantined_rank_with_no_gpu_left_shrinks_the_job_and_grows_back_on_release(
    tmp_path: Path, reference_1d: dict[tuple[int, int], tuple[float, str]]
) -> None:
    """4 -> 3: GPU 2 is quarantined and no GPU is left for its rank; the other three reshard every rank's host
    snapshot of the newest common step onto a 3-rank mesh, each step once after the rollback; when GPU 2 is
    released its new rank joins and the state is resharded onto 4 ranks again, and the job finishes.
    The loss is a function of the parameters before the step's update and the batch of the rank's dp index:
    new rank i's loss at the first step after the shrink equals an uninterrupted 4-rank run's rank i's at that
    step, so the resharded parameters are those of the step rolled back to, on every rank."""
    with sim_node(tmp_path / "node", gpus=RANKS) as node:
        run = launch_fsdp(node, tmp_path, GROWN_STEPS, every=K, step_sleep=0.1, worker_args=["--shrink"])
        run.wait_for("4 ranks past step 15", lambda ls: len({ln["pid"] for ln in ls if ln["step"] >= 15}) == 4, 300)
        leaver = next(ln["pid"] for ln in run.steps() if ln["rank"] == 2)
        decided = post(node, "/v1/gpus/2/quarantine", {"reason": "test"})
        run.wait_for("30 steps at 3 ranks", lambda ls: len([ln for ln in ls if ln["world"] == 3]) >= 90, 120)
        post(node, "/v1/gpus/2/release", {"reason": "test", "force": True})
        out, err = run.output(240)
    assert run.process.returncode == 0, err
    lines = run.steps()
    logs = by_pid(lines)
    survivors = sorted(pid for pid in logs if pid != leaver and logs[pid][0]["t"] < decided)
    assert len(survivors) == 3 and all(logs[pid][-1]["step"] == GROWN_STEPS for pid in survivors), survivors
    shrunk = [ln for ln in lines if ln["world"] == 3]
    first = min(shrunk, key=lambda ln: ln["t"])
    resumed = first["step"]
    assert first["change"]["source"] == "resharded", first
    after = {ln["rank"]: ln["loss"] for ln in shrunk if ln["step"] == resumed}
    assert after == {r: reference_1d[(resumed, r)][0] for r in range(3)}, (resumed, after)
    grown = [ln for ln in lines if ln["world"] == 4 and ln["t"] > first["t"]]
    regrown = min(grown, key=lambda ln: ln["t"])  # the released GPU's new rank joined: 3 -> 4, resharded again
    assert regrown["change"]["source"] == "resharded" and regrown["step"] <= max(ln["step"] for ln in shrunk) + 1
    for step in range(resumed, regrown["step"]):  # every step once after the shrink's rollback, on each of the three
        assert sorted(ln["rank"] for ln in shrunk if ln["step"] == step) == [0, 1, 2], step
    for step in range(regrown["step"], GROWN_STEPS + 1):  # and after the growth's, on each of the four
        assert sorted(ln["rank"] for ln in grown if ln["step"] == step) == [0, 1, 2, 3], step
    assert "left (exit 75)" in err, err
    print(f"\nFSDP2 4 -> 3 after a quarantine: first 3-rank step {first['t'] - decided:.2f} s after the decision,"
          f" resumed at {resumed}; 3 -> 4 after the release, resumed at {regrown['step']}")  # fmt: skip
