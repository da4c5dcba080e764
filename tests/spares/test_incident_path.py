"""The daemon's record of a recovery through a spare: an incident's path becomes `spare` when the job came back
through a process whose report says a warm spare took its rank over, and stays `in_place` when the survivors
went on without it (a replicated job's spare joins at a later step)."""

from __future__ import annotations

import pytest

from gpuwatch.model import TrainerInfo
from gpuwatch.remediation.incidents import PATH_IN_PLACE, PATH_RELAUNCH, Incident
from gpuwatch.remediation.resumes import ResumeWatches
from gpuwatch.reports.board import Report

JOB = (1000, "job")
KILLED = 100.0  # when the fault began
LAST = 40  # the furthest step before it


def _incident(path: str) -> Incident:
    incident = Incident("rank_died", 0, "GPU-0", "rank_died", "rank 1 died", KILLED, 0.0, 0.0, frozenset([JOB]), [])
    incident.path, incident.status = path, "stopped"
    incident.gone_pids.add(7)
    incident.see_step(LAST)
    return incident


def _report(
    pid: int, step: int, first_step: int, first_step_t: float, *, spare: bool, stage: str | None = None
) -> Report:
    info = TrainerInfo(pid=pid, job_id=JOB[1], step=step, step_t=KILLED + 2, first_step=first_step,
                       first_step_t=first_step_t, spare=spare, spare_stage=stage, recovery="in_place")  # fmt: skip
    return Report(info, JOB[0], alive=True)


def _watch(incident: Incident, reports: list[Report]) -> str:
    ended: list[str] = []
    watches = ResumeWatches(lambda _incident, status: ended.append(status))
    watches.watch(incident)
    watches.check(reports, now_mono=1.0)
    assert ended == ["resumed"], ended
    return incident.path


def test_a_one_rank_job_brought_back_by_a_spare_is_recorded_as_spare() -> None:
    incident = _incident(PATH_RELAUNCH)  # no survivor: the relaunch watch
    assert _watch(incident, [_report(8, 42, 38, KILLED + 1, spare=True)]) == "spare"
    assert (incident.resumed_step, incident.steps_lost) == (37, LAST - 37)  # the steps it redid


def test_a_cold_replacement_stays_a_relaunch() -> None:
    assert _watch(_incident(PATH_RELAUNCH), [_report(8, 42, 38, KILLED + 1, spare=False)]) == "relaunch"


@pytest.mark.parametrize(
    ("spare_first_step", "path"),
    [
        (LAST - 2, "spare"),  # sharded: every rank rolled back and the spare's first step was the job's next
        (LAST + 1, "spare"),
        (LAST + 2, PATH_IN_PLACE),  # replicated: the survivors took step LAST + 1 without it; it joined later
    ],
)
def test_in_place_the_path_is_spare_only_when_the_spare_took_the_next_step(spare_first_step: int, path: str) -> None:
    survivor = _report(5, LAST + 3, 1, 10.0, spare=False)
    spare = _report(8, LAST + 3, spare_first_step, KILLED + 0.5, spare=True)
    assert _watch(_incident(PATH_IN_PLACE), [survivor, spare]) == path


@pytest.mark.parametrize("stage", ["standby", "warm", "starting"])
def test_the_incident_says_how_far_the_spare_that_brought_the_job_back_was(stage: str) -> None:
    incident = _incident(PATH_RELAUNCH)
    assert _watch(incident, [_report(8, 42, 38, KILLED + 1, spare=True, stage=stage)]) == "spare"
    assert incident.spare_stage == stage and incident.body()["spare_stage"] == stage
