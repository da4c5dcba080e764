"""A vanished rank's death is dated by its launcher's exit note, else by the step it never finished, never by
the end of its teardown."""

from __future__ import annotations

import pytest

from gpuwatch.model import TrainerInfo
from gpuwatch.node.ranks import Rank
from gpuwatch.remediation.incidents import Incident, Target
from gpuwatch.remediation.onset import death_onset, launcher_onset
from gpuwatch.reports import Report


@pytest.mark.parametrize(
    ("step_t", "mean", "p99", "seen", "onset"),
    [
        (100.0, 0.09, 0.12, 101.5, 100.12),  # killed mid-step, seen after a 1.4 s teardown: the step's end
        (100.0, 0.09, None, 101.5, 100.09),  # no p99 yet: the mean step
        (100.0, 5.0, 8.0, 101.5, 101.5),  # a slow step still running when it was seen gone: the sighting
        (None, 0.09, 0.12, 101.5, 101.5),  # no step yet: nothing better than the sighting
        (100.0, None, None, 101.5, 101.5),  # no step time reported yet
        (102.0, 0.09, 0.12, 101.5, 101.5),  # a step page from the future (a wrong clock) is not believed
    ],
)
def test_a_death_is_dated_no_later_than_the_step_it_never_finished(
    step_t: float | None, mean: float | None, p99: float | None, seen: float, onset: float
) -> None:
    info = TrainerInfo(pid=7, step_t=step_t, step_time_s=mean, step_time_p99_s=p99)
    assert death_onset(info, seen) == pytest.approx(onset)


@pytest.mark.parametrize(
    ("exit_t", "onset"),
    [
        (101.2, 101.2),  # the launcher saw the exit begin 1.2 s into a slow step: that, not the step-time guess
        (100.05, 100.05),  # ... or before the guess: still the launcher's time
        (101.9, 101.5),  # the note a little after the sighting (clocks): never later than the sighting
        (103.0, 100.12),  # a note far after the sighting is no date of this death: the guess
        (None, 100.12),  # no note (another launcher): the guess
    ],
)
def test_the_launchers_exit_time_dates_the_death_when_there_is_one(exit_t: float | None, onset: float) -> None:
    info = TrainerInfo(pid=7, step_t=100.0, step_time_s=0.09, step_time_p99_s=0.12)
    assert death_onset(info, 101.5, exit_t) == pytest.approx(onset)


def _incident(kind: str = "rank_died") -> Incident:
    dead = Target(Rank(TrainerInfo(pid=7, job_id="j"), 0, 1000, None, ("report",)), True, "died")
    incident = Incident(kind, 0, "GPU-0", kind, "rank 0 died", 101.5, 0.0, 0.0, frozenset([(1000, "j")]), [dead])
    incident.began_t = 100.12  # the guess, made before the note was read
    return incident


def _dead(exit_t: float | None, pid: int = 7) -> Report:
    return Report(TrainerInfo(pid=pid, job_id="j"), 1000, alive=False, exit_t=exit_t)


def test_a_note_read_after_the_incident_opened_still_dates_it() -> None:
    incident = _incident()
    assert launcher_onset(incident, [_dead(101.2)])
    assert incident.began == pytest.approx(101.2)
    incident.resumed(40, 102.0)
    assert incident.time_to_resume_s == pytest.approx(0.8)
    assert not launcher_onset(incident, [_dead(101.2)])  # once


@pytest.mark.parametrize(
    ("reports", "kind", "resumed"),
    [
        ([_dead(None)], "rank_died", False),  # no note
        ([_dead(101.2, pid=8)], "rank_died", False),  # another process's note
        ([_dead(104.0)], "rank_died", False),  # dated well after the daemon saw the death
        ([_dead(101.2)], "gpu_fault", False),  # an XID's own time is the onset
        ([_dead(101.2)], "rank_died", True),  # the job is back: its figures stand
    ],
)
def test_a_note_changes_nothing_where_it_does_not_date_this_death(
    reports: list[Report], kind: str, resumed: bool
) -> None:
    incident = _incident(kind)
    if resumed:
        incident.resumed(40, 102.0)
    assert not launcher_onset(incident, reports)
    assert incident.began == pytest.approx(100.12)
