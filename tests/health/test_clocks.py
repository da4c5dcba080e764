"""clocks.py: low SM clock only when nothing explains it; each fault reason bit by its duty."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health.rules import clocks
from gpuwatch.model import Action, Severity

from .helpers import BUSY, H200, IDLE, history, rules, series

CFG = RulesConfig()
LOW_UNEXPLAINED: dict[str, Any] = {**BUSY, "sm_clock_mhz": 500, "power_w": 250.0, "clocks_event_reasons": 0}


def hw(bit: int, clock: int = 600) -> dict[str, Any]:
    return {**BUSY, "sm_clock_mhz": clock, "power_w": 300.0, "clocks_event_reasons": bit}


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (LOW_UNEXPLAINED, {"sm_clock_low_unexplained"}),
        (hw(0x8), {"clocks_hw_slowdown"}),
        (hw(0x20, clock=1100), {"clocks_sw_thermal"}),
        (hw(0x40), {"clocks_hw_thermal"}),
        (hw(0x80), {"clocks_hw_power_brake"}),
        (hw(0x8 | 0x40), {"clocks_hw_slowdown", "clocks_hw_thermal"}),
        # must not fire: the measured healthy H200 at full load (72-77% of max, SW power cap)
        (BUSY, set()),
        ({**BUSY, "sm_clock_mhz": 1425}, set()),
        # must not fire: low clocks that a benign reason explains, or a GPU that is not busy
        (IDLE, set()),
        ({**LOW_UNEXPLAINED, "clocks_event_reasons": 0x4}, set()),
        ({**LOW_UNEXPLAINED, "clocks_event_reasons": 0x2}, set()),
        ({**LOW_UNEXPLAINED, "util_gpu_pct": 20}, set()),
        ({**LOW_UNEXPLAINED, "clocks_event_reasons": None}, set()),
        # full clock at full load with no reason (the trace's light-kernel phase)
        ({**BUSY, "sm_clock_mhz": 1980, "power_w": 475.0, "clocks_event_reasons": 0}, set()),
    ],
)
def test_sustained_condition(fields: dict[str, Any], expected: set[str], interval_s: float) -> None:
    found = clocks.evaluate(history(series(180, interval_s, fields)), CFG)
    assert rules(found) == expected
    assert all(f.severity is Severity.DEGRADED for f in found)


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
def test_short_blip_does_not_fire(interval_s: float) -> None:
    """A throttle seen on one 30 s sample, or for 20 s at 1 s, is under half of the 60 s window."""
    samples = series(180, interval_s, lambda t: hw(0x8) if 150 <= t < 170 else BUSY)
    assert clocks.evaluate(history(samples), CFG) == []


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
def test_needs_the_window_not_just_the_samples(interval_s: float) -> None:
    """A daemon that just started cannot claim a throttle held for half of the last minute."""
    samples = series(20, interval_s, hw(0x8)) if interval_s == 1.0 else series(0, interval_s, hw(0x8))
    assert clocks.evaluate(history(samples), CFG) == []


def test_fires_once_the_duty_is_reached_at_both_intervals() -> None:
    """Fault from t=120: at 30 s it takes two throttled samples; at 1 s half of the window."""

    def fault(t: float) -> dict[str, Any]:
        return hw(0x8) if t >= 120 else BUSY

    coarse = series(240, 30.0, fault)
    assert clocks.evaluate(history(coarse[:5]), CFG) == []  # t=120: one throttled sample
    assert rules(clocks.evaluate(history(coarse[:6]), CFG)) == {"clocks_hw_slowdown"}  # t=150
    fine = series(240, 1.0, fault)
    assert clocks.evaluate(history(fine[:148]), CFG) == []  # t=147
    assert rules(clocks.evaluate(history(fine[:151]), CFG)) == {"clocks_hw_slowdown"}  # t=150


def test_fault_bits_are_not_also_an_unexplained_low_clock() -> None:
    found = clocks.evaluate(history(series(120, 1.0, hw(0x8, clock=500))), CFG)
    assert rules(found) == {"clocks_hw_slowdown"}


def test_reason_names_duty_and_clocks() -> None:
    samples = series(120, 1.0, lambda t: hw(0x8) if t > 72 else BUSY)
    (found,) = clocks.evaluate(history(samples), CFG)
    assert found.reason == "HW slowdown active 80% of the last 60 s; SM clock 600 of 1980 MHz"
    assert found.action is Action.HARDWARE_INSPECTION
    assert found.t == samples[-1].t and found.index == 0 and found.uuid == samples[-1].uuid


def test_low_clock_needs_most_of_the_window() -> None:
    """level_duty 0.8: low for 40 of 60 s is not enough, 50 of 60 s is."""

    def low_from(start: float) -> list[Any]:
        return series(120, 1.0, lambda t: LOW_UNEXPLAINED if t > start else BUSY)

    assert clocks.evaluate(history(low_from(80)), CFG) == []
    assert rules(clocks.evaluate(history(low_from(70)), CFG)) == {"sm_clock_low_unexplained"}


def test_unknown_max_clock_judges_no_low_clock() -> None:
    static = replace(H200, max_sm_clock_mhz=None)
    assert clocks.evaluate(history(series(120, 1.0, LOW_UNEXPLAINED), static=static), CFG) == []


def test_window_as_short_as_the_interval() -> None:
    """The sim's fast scenarios use a 30 s window; at 30 s sampling two throttled readings in a row suffice."""
    fast = replace(CFG, clock_window_s=30.0)
    samples = series(240, 30.0, lambda t: hw(0x8) if t >= 180 else BUSY)
    assert clocks.evaluate(history(samples[:7]), fast) == []  # t=180: one throttled reading
    assert rules(clocks.evaluate(history(samples[:8]), fast)) == {"clocks_hw_slowdown"}  # t=210


def test_sampling_jitter() -> None:
    """Real ticks drift: 30 s ± 0.4 s leaves two or three samples in a 60 s window, and the verdict stands."""
    samples = [replace(s, t=s.t + (0.4 if i % 2 else -0.4)) for i, s in enumerate(series(300, 30.0, hw(0x8)))]
    for end in range(3, len(samples) + 1):
        assert rules(clocks.evaluate(history(samples[:end]), CFG)) == {"clocks_hw_slowdown"}
