"""power.py: repeated unexplained collapses fire; the healthy DDP swing never does."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health import engine
from gpuwatch.health.rules import power
from gpuwatch.model import Action, Severity

from .helpers import BUSY, IDLE, bad, history, rolling, rules, series

CFG = RulesConfig()
COLLAPSED: dict[str, Any] = {**BUSY, "sm_clock_mhz": 1000, "power_w": 120.0, "clocks_event_reasons": 0}


def ddp_swing(seed: int, reasons: tuple[int, ...]) -> Any:
    """A healthy 2-rank DDP job as measured: 290-680 W at 100% util, compute and all-reduce phases."""
    rng = random.Random(seed)

    def fields(t: float) -> dict[str, Any]:
        reason = rng.choice(reasons)
        clock = rng.choice(range(1425, 1516, 15)) if reason == 0x4 else rng.choice((1455, 1755, 1980))
        return {**BUSY, "power_w": rng.uniform(290, 680), "sm_clock_mhz": clock, "clocks_event_reasons": reason}

    return fields


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
@pytest.mark.parametrize("reasons", [(0x4,), (0x0,), (0x0, 0x4)])
def test_ddp_power_swing_never_fires(interval_s: float, reasons: tuple[int, ...]) -> None:
    samples = series(600 if interval_s == 1.0 else 3600, interval_s, ddp_swing(7, reasons))
    for h in rolling(samples, CFG):
        assert bad(engine.evaluate(h, CFG)) == []


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
@pytest.mark.parametrize(
    ("fault", "fires"),
    [
        # every other sample collapses with no reason: unstable
        (lambda t, i: COLLAPSED if i % 2 else BUSY, True),
        # a power brake that comes and goes is instability too
        (lambda t, i: {**COLLAPSED, "clocks_event_reasons": 0x80} if i % 2 else BUSY, True),
        # a card throttled throughout whose power wanders across the line is never at speed: no fall
        (lambda t, i: {**COLLAPSED, "clocks_event_reasons": 0x40, "power_w": 300.0 if i % 2 else 400.0}, False),
        # a collapse that holds is one fall (sm_clock_low_unexplained's business), not instability
        (lambda t, i: COLLAPSED if t >= 30 else BUSY, False),
        # bursty job: each ramp-up from idle starts low, which is not a fall
        (lambda t, i: IDLE if i % 3 == 0 else (COLLAPSED if i % 3 == 1 else BUSY), False),
        # low power at full clock (all-reduce) or under the SW power cap
        (lambda t, i: {**BUSY, "power_w": 120.0, "sm_clock_mhz": 1980, "clocks_event_reasons": 0}, False),
        (lambda t, i: {**COLLAPSED, "clocks_event_reasons": 0x4} if i % 2 else BUSY, False),
        # collapses while not busy enough
        (lambda t, i: {**COLLAPSED, "util_gpu_pct": 60} if i % 2 else BUSY, False),
    ],
)
def test_falls(fault: Any, fires: bool, interval_s: float) -> None:
    count = int(120 // interval_s) + 1
    samples = series(120, interval_s, lambda t: fault(t, round(t / interval_s)))
    assert len(samples) == count
    found = power.evaluate(history(samples), CFG)
    assert rules(found) == ({"power_unstable"} if fires else set())
    assert all(f.severity is Severity.DEGRADED and f.action is Action.HARDWARE_INSPECTION for f in found)


def test_falls_outside_the_window_do_not_count() -> None:
    samples = series(300, 30.0, lambda t: COLLAPSED if t in (60, 120) else BUSY)
    assert rules(power.evaluate(history(samples[:6]), CFG)) == {"power_unstable"}  # t=150
    assert power.evaluate(history(samples), CFG) == []  # t=300: both falls older than 120 s


def test_healthy_trace_phases_are_not_falls(healthy_trace: Any) -> None:
    static, samples = healthy_trace
    for h in rolling(samples, CFG, static):
        assert power.evaluate(h, CFG) == []
