"""The daemon's record of a recovery through a spare: an incident's path becomes `spare` when the job came back
through a process whose report says a warm spare took its rank over, and stays `in_place` when the survivors
went on without it (a replicated job's spare joins at a later step)."""

from __future__ import annotations

import pytest

from gpuwatch.model import TrainerInfo
from gpuwatch.node.ranks import Rank
from gpuwatch.remediation.incidents import PATH_IN_PLACE, PATH_RELAUNCH, Incident, Target
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
    pid: int,
    step: int,
    first_step: int,
    first_step_t: float,
    *,
    spare: bool,
    stage: str | None = None,
    step_t: float = KILLED + 2,
) -> Report:
    info = TrainerInfo(pid=pid, job_id=JOB[1], step=step, step_t=step_t, first_step=first_step,
                       first_step_t=first_step_t, spare=spare, spare_stage=stage, recovery="in_place")  # fmt: skip
    return Report(info, JOB[0], alive=True)


def _survivor(pid: int, step: int, step_t: float) -> Report:
    """A survivor's report with its step page read in: stepping since long before the fault."""
    return _report(pid, step, 1, 10.0, spare=False, step_t=step_t)


def _waiting_spare() -> Report:
    """The spare that took the lost rank over: its first report is in (sent as its link started), no step yet."""
    return Report(TrainerInfo(pid=8, job_id=JOB[1], spare=True, recovery="in_place"), JOB[0], alive=True)


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


def _reads(incident: Incident, reads: list[list[Report]]) -> list[list[str]]:
    """How the watch ended at each of these successive reads of the reports (nothing: still watching)."""
    ended: list[str] = []
    watches = ResumeWatches(lambda _incident, status: ended.append(status))
    watches.watch(incident)
    seen = []
    for reports in reads:
        before = len(ended)
        watches.check(reports, now_mono=1.0)
        seen.append(ended[before:])
    return seen


def test_a_sharded_jobs_survivors_first_step_after_the_rollback_waits_for_the_spare_in_it() -> None:
    """Failed once in CI (tests/inplace/test_sharded_in_place.py), path in_place: the survivors roll back to step
    LAST - 2 and wait for the spare; their first step after the rollback, taken with it, ends on every rank
    together, but their pages come first (their log lines 0.9-2.4 ms before the spare's in 5 of 6 CPU runs). A
    read between the two must not end the watch: the spare's first step, read next, says how the job came back."""
    incident = _incident(PATH_IN_PLACE)
    rolled_back = [_survivor(5, LAST - 1, KILLED + 0.193), _survivor(6, LAST - 1, KILLED + 0.193)]
    spare = _report(8, LAST - 1, LAST - 1, KILLED + 0.195, spare=True, stage="standby", step_t=KILLED + 0.195)
    assert _reads(incident, [[*rolled_back, _waiting_spare()], [*rolled_back, spare]]) == [[], ["resumed"]]
    assert (incident.path, incident.spare_stage) == ("spare", "standby")
    assert (incident.resumed_step, incident.steps_lost, incident.time_to_resume_s) == (LAST - 2, 2, 0.195)


@pytest.mark.parametrize("in_flight", [LAST, LAST + 1])
def test_a_step_in_flight_at_the_fault_whose_page_came_after_it_does_not_end_the_watch(in_flight: int) -> None:
    """A step whose collectives ended before the kill, the lost rank in them, and whose survivors' pages were written
    just after it: LAST (the lost rank wrote its own page too) or LAST + 1 (killed before it wrote its own). No sign
    of the job's return, nor its time: the spare's first step after the rollback gives both."""
    incident = _incident(PATH_IN_PLACE)
    at_fault = [_survivor(5, in_flight, KILLED + 0.004), _survivor(6, in_flight, KILLED + 0.006)]
    spare = _report(8, LAST - 1, LAST - 1, KILLED + 0.195, spare=True, step_t=KILLED + 0.195)
    reads = [[*at_fault, _waiting_spare()], [at_fault[0], _survivor(6, LAST - 1, KILLED + 0.193), spare]]
    assert _reads(incident, reads) == [[], ["resumed"]]
    assert incident.path == "spare"
    assert (incident.resumed_step, incident.steps_lost, incident.time_to_resume_s) == (LAST - 2, 2, 0.195)


def test_a_replicated_jobs_survivors_that_go_on_without_the_spare_are_in_place_one_step_on() -> None:
    """A replicated job's survivors re-form without the lost rank and take step LAST + 1, which a page alone cannot
    tell from one in flight at the fault; their next, LAST + 2, the lost rank cannot have been in: in place, at
    once, while the spare that joins at a later step has not stepped yet."""
    incident = _incident(PATH_IN_PLACE)
    first = [_survivor(5, LAST + 1, KILLED + 0.08), _survivor(6, LAST + 1, KILLED + 0.08)]
    second = [_survivor(5, LAST + 2, KILLED + 0.11), _survivor(6, LAST + 2, KILLED + 0.11)]
    assert _reads(incident, [[*first, _waiting_spare()], [*second, _waiting_spare()]]) == [[], ["resumed"]]
    assert incident.path == PATH_IN_PLACE
    assert (incident.resumed_step, incident.steps_lost, incident.time_to_resume_s) == (LAST + 1, 0, 0.11)


@pytest.mark.parametrize("stage", ["standby", "warm", "starting"])
def test_the_incident_says_how_far_the_spare_that_brought_the_job_back_was(stage: str) -> None:
    incident = _incident(PATH_RELAUNCH)
    assert _watch(incident, [_report(8, 42, 38, KILLED + 1, spare=True, stage=stage)]) == "spare"
    assert incident.spare_stage == stage and incident.body()["spare_stage"] == stage


def _second_fault(reports: list[Report]) -> tuple[Incident, dict[int, str]]:
    """The job's first incident awaits its resume when a second one of the same job opens: how each watch ended."""
    first = _incident(PATH_RELAUNCH)
    ended: dict[int, str] = {}

    def end(incident: Incident, status: str) -> None:
        incident.status = status
        ended[id(incident)] = status

    watches = ResumeWatches(end)
    watches.watch(first)
    second = Incident("rank_died", 0, "GPU-0", "rank_died", "rank 1 died", KILLED + 5, 0.0, 0.0, frozenset([JOB]), [])
    watches.watch(second, reports)
    assert watches.incidents() == [second]
    return first, ended


def test_a_second_fault_before_the_job_came_back_ends_the_first_incident_as_interrupted() -> None:
    first, ended = _second_fault([])  # nothing stepped since the first fault
    assert ended == {id(first): "interrupted"} and first.body()["status"] == "interrupted"


def test_a_second_fault_after_the_job_came_back_unseen_ends_the_first_incident_as_resumed() -> None:
    """The spare stepped after the first fault (the daemon had not read its report yet) and was lost in turn."""
    first, ended = _second_fault([_report(8, 39, 38, KILLED + 1, spare=True, stage="standby")])
    assert ended == {id(first): "resumed"}
    assert (first.path, first.spare_stage, first.resumed_step, first.steps_lost) == ("spare", "standby", 37, 3)
    assert first.time_to_resume_s == 1.0


def test_a_death_seen_after_the_spare_already_stepped_still_resumes() -> None:
    """A warm spare can step before the daemon sees the death (a loaded node): its first step came after the dead
    rank's last one, so it is the job's return all the same."""
    incident = _incident(PATH_RELAUNCH)  # the death seen at KILLED
    dead = TrainerInfo(pid=7, job_id=JOB[1], step=LAST, step_t=KILLED - 0.6)
    incident.targets.append(Target(Rank(dead, 0, JOB[0], None, ("report",)), True, "died"))
    assert _watch(incident, [_report(8, 39, 38, KILLED - 0.2, spare=True, stage="standby")]) == "spare"
    assert incident.resumed_step == 37 and incident.time_to_resume_s == 0.0
