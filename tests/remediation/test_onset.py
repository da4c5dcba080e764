"""A vanished rank's death is dated by the step it never finished, not by the end of its teardown."""

from __future__ import annotations

import pytest

from gpuwatch.model import TrainerInfo
from gpuwatch.remediation.onset import death_onset


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
