"""thermal.py: most of the window within the margin of the slowdown (GPU) or maximum (HBM) temperature."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health.rules import thermal
from gpuwatch.model import Action, Severity

from .helpers import BUSY, H200, history, rules, series

CFG = RulesConfig()


@pytest.mark.parametrize("interval_s", [1.0, 30.0])
@pytest.mark.parametrize(
    ("fields", "fires"),
    [
        ({**BUSY, "temp_c": 86}, True),  # 3 °C from the 89 °C slowdown
        ({**BUSY, "temp_c": 84}, True),  # exactly the 5 °C margin
        ({**BUSY, "mem_temp_c": 92}, True),  # HBM 3 °C from its 95 °C maximum
        ({**BUSY, "temp_c": 83, "mem_temp_c": 89}, False),
        (BUSY, False),
        ({**BUSY, "temp_c": None, "mem_temp_c": None}, False),
        # hot for 20 s of the last minute only
        (lambda t: {**BUSY, "temp_c": 87} if 150 <= t < 170 else BUSY, False),
    ],
)
def test_margin(fields: Any, fires: bool, interval_s: float) -> None:
    found = thermal.evaluate(history(series(180, interval_s, fields)), CFG)
    assert rules(found) == ({"thermal_margin_low"} if fires else set())
    assert all(f.severity is Severity.DEGRADED and f.action is Action.HARDWARE_INSPECTION for f in found)


def test_unknown_limits_judge_nothing() -> None:
    static = replace(H200, slowdown_temp_c=None, mem_max_temp_c=None)
    assert thermal.evaluate(history(series(180, 1.0, {**BUSY, "temp_c": 99}), static=static), CFG) == []


def test_reason_names_temperatures() -> None:
    (found,) = thermal.evaluate(history(series(120, 30.0, {**BUSY, "temp_c": 86})), CFG)
    assert "GPU 86 °C (slowdown 89 °C)" in found.reason and "100% of the last 60 s" in found.reason
