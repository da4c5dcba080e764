"""ecc.py: new double-bit errors condemn the card; single-bit ones only by rate; old ones age out."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health.rules import ecc
from gpuwatch.model import Action, Severity

from .helpers import BUSY, event, history, rules, sample, series

CFG = RulesConfig()
HOUR = 3600.0


def counters(after_s: float, **fields: int) -> Any:
    """BUSY until `after_s`, then with `fields` (counters) set."""
    return lambda t: {**BUSY, **fields} if t >= after_s else BUSY


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (counters(100, ecc_dbe_volatile=1, ecc_dbe_aggregate=1), {"ecc_uncorrectable"}),
        (counters(100, ecc_dbe_aggregate=1), {"ecc_uncorrectable"}),  # volatile not supported or reset
        # 3000 correctable errors a minute: far above 1000 an hour
        (lambda t: {**BUSY, "ecc_sbe_volatile": int(t * 50)}, {"ecc_correctable_rate"}),
        (lambda t: {**BUSY, "ecc_sbe_aggregate": int(t * 50)}, {"ecc_correctable_rate"}),
        # must not fire: a few correctable errors, or none
        (lambda t: {**BUSY, "ecc_sbe_volatile": int(t / 60)}, set()),
        (BUSY, set()),
        # must not fire: errors the GPU carried before the daemon started watching
        ({**BUSY, "ecc_dbe_volatile": 2, "ecc_dbe_aggregate": 5, "ecc_sbe_aggregate": 90_000}, set()),
        # must not fire: counters not supported
        ({**BUSY, "ecc_dbe_volatile": None, "ecc_dbe_aggregate": None}, set()),
    ],
)
def test_counters(fields: Any, expected: set[str], interval_s: float) -> None:
    found = ecc.evaluate(history(series(600, interval_s, fields)), CFG)
    assert rules(found) == expected


def test_uncorrectable_is_unhealthy_and_asks_for_a_reset() -> None:
    (found,) = ecc.evaluate(history(series(600, 30.0, counters(300, ecc_dbe_volatile=1))), CFG)
    assert (found.severity, found.action) == (Severity.UNHEALTHY, Action.RESET_GPU)
    assert found.reason == "1 new uncorrectable (double-bit) ECC error(s) in the last 3600 s"


def test_correctable_rate_is_degraded_without_action() -> None:
    samples = series(600, 30.0, lambda t: {**BUSY, "ecc_sbe_volatile": int(t * 50)})
    (found,) = ecc.evaluate(history(samples), CFG)
    assert (found.severity, found.action) == (Severity.DEGRADED, Action.NONE)


def test_dbe_ages_out_of_the_window() -> None:
    samples = series(2 * HOUR, 30.0, counters(600, ecc_dbe_volatile=1, ecc_dbe_aggregate=1))
    at_hour = [s for s in samples if s.t - samples[0].t <= 600 + HOUR - 30]
    assert rules(ecc.evaluate(history(at_hour), CFG)) == {"ecc_uncorrectable"}
    assert ecc.evaluate(history(samples), CFG) == []


def test_gpu_reset_clears_volatile_without_counting_growth() -> None:
    """Volatile DBE 1 → 0 at a reset is not growth; the aggregate stays where it was."""
    samples = [sample(0, ecc_dbe_volatile=1, ecc_dbe_aggregate=1), sample(30, ecc_dbe_aggregate=1)]
    assert ecc.evaluate(history(samples), CFG) == []


def test_trimmed_history_does_not_date_old_growth_into_the_window() -> None:
    """Baseline from hours ago, kept samples all newer than the window start: growth between them is old."""
    baseline = sample(0)
    kept = [sample(3 * HOUR + i * 30, ecc_dbe_aggregate=1) for i in range(121)]
    assert ecc.evaluate(history(kept, baseline=baseline), CFG) == []


def test_baseline_inside_the_window_counts() -> None:
    baseline = sample(0)
    assert rules(ecc.evaluate(history([sample(30, ecc_dbe_volatile=1)], baseline=baseline), CFG)) == {
        "ecc_uncorrectable"
    }


@pytest.mark.parametrize("drill", [False, True])
def test_dbe_event_alone_fires(drill: bool) -> None:
    samples = series(120, 30.0)
    (found,) = ecc.evaluate(history(samples, events=[event(100, "ecc_dbe", drill=drill)]), CFG)
    assert found.rule == "ecc_uncorrectable" and found.drill is drill


def test_dbe_event_older_than_window_is_ignored() -> None:
    samples = series(HOUR + 200, 30.0)
    assert ecc.evaluate(history(samples, events=[event(100, "ecc_dbe")]), CFG) == []
