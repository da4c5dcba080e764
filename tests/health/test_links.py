"""links.py: PCIe trained down while busy, PCIe/NVLink error rates, NVLinks down, fabric not ready.

Each rule is judged both ways (the windowed reference and the running state the daemon uses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health import engine
from gpuwatch.health.rules import links
from gpuwatch.health.running import RunningState
from gpuwatch.model import Action, Finding, GpuSample, GpuStatic, Severity

from .helpers import BUSY, H200, IDLE, rolling, series

CFG = RulesConfig()
STATIC = dataclasses.replace(H200, pcie_link_gen_max=5, pcie_link_width_max=16)
LINK_OK: dict[str, Any] = {"pcie_link_gen": 5, "pcie_link_width": 16, "pcie_correctable_errors": 0}


def both_ways(samples: Sequence[GpuSample], static: GpuStatic = STATIC, cfg: RulesConfig = CFG) -> list[Finding]:
    """The findings of links.py at the last sample, asserting the running state agrees with the reference."""
    reference: list[Finding] = []
    for hist in rolling(samples, cfg, static):
        reference = links.evaluate(hist, cfg)
    state = RunningState(static, links.conditions(static, cfg), engine.max_window_s(cfg) + 60.0)
    for s in samples:
        state.add(s)
    running = links.judge(state.at(samples[-1].t), cfg)
    assert running == reference
    return running


def test_pcie_x8_while_busy_fires() -> None:
    found = both_ways(series(120, 5, {**BUSY, **LINK_OK, "pcie_link_width": 8}))
    assert [(f.rule, f.severity, f.action) for f in found] == [
        ("pcie_link_degraded", Severity.DEGRADED, Action.HARDWARE_INSPECTION)
    ]
    assert "gen 5 x8 of gen 5 x16" in found[0].reason


def test_pcie_lower_generation_while_busy_fires() -> None:
    found = both_ways(series(120, 5, {**BUSY, **LINK_OK, "pcie_link_gen": 3}))
    assert [f.rule for f in found] == ["pcie_link_degraded"]


def test_pcie_trained_down_at_idle_is_silence() -> None:
    """Links may train down at idle to save power: never judged then."""
    assert both_ways(series(600, 5, {**IDLE, **LINK_OK, "pcie_link_gen": 1, "pcie_link_width": 4})) == []


def test_pcie_down_only_briefly_while_busy_is_silence() -> None:
    def fields(t: float) -> dict[str, Any]:
        busy = t >= 100  # busy, x8, for the last 20 s of a 60 s window (under link_duty 0.5)
        return {**(BUSY if busy else IDLE), **LINK_OK, "pcie_link_width": 8}

    assert both_ways(series(120, 5, fields)) == []


def test_pcie_without_maximum_or_reading_is_silence() -> None:
    assert both_ways(series(120, 5, {**BUSY, "pcie_link_width": 8}), static=H200) == []
    assert both_ways(series(120, 5, {**BUSY, "pcie_link_gen": None, "pcie_link_width": None})) == []


def test_pcie_error_rate() -> None:
    # 100 per hour over a 3600 s window: 101 errors fire, 100 do not.
    rising = series(300, 10, lambda t: {**BUSY, **LINK_OK, "pcie_correctable_errors": round(t / 300 * 101)})
    assert [f.rule for f in both_ways(rising)] == ["pcie_error_rate"]
    under = series(300, 10, lambda t: {**BUSY, **LINK_OK, "pcie_correctable_errors": round(t / 300 * 100)})
    assert both_ways(under) == []
    # errors the card carried before the daemon started are no rate
    assert both_ways(series(300, 10, {**BUSY, **LINK_OK, "pcie_correctable_errors": 50_000})) == []


def test_pcie_replays_count_in_the_rate() -> None:
    rising = series(300, 10, lambda t: {**BUSY, **LINK_OK, "pcie_replay": round(t)})
    assert [f.rule for f in both_ways(rising)] == ["pcie_error_rate"]


NVLINK_OK: dict[str, Any] = {"nvlink_links_down": 0, "nvlink_crc_errors": 0, "nvlink_recovery_errors": 0}


def test_nvlink_down_fires_busy_or_idle() -> None:
    for load in (BUSY, IDLE):
        found = both_ways(series(120, 5, {**load, **LINK_OK, **NVLINK_OK, "nvlink_links_down": 2}))
        assert [(f.rule, f.action) for f in found] == [("nvlink_down", Action.RESET_GPU)]
        assert "2 NVLink(s) not active" in found[0].reason


def test_nvlink_error_rates() -> None:
    crc = series(300, 10, lambda t: {**BUSY, **LINK_OK, **NVLINK_OK, "nvlink_crc_errors": round(t)})
    assert [f.rule for f in both_ways(crc)] == ["nvlink_error_rate"]
    recovery = series(300, 10, lambda t: {**BUSY, **LINK_OK, **NVLINK_OK, "nvlink_recovery_errors": round(t)})
    assert [f.rule for f in both_ways(recovery)] == ["nvlink_error_rate"]


def test_pcie_only_card_is_silence() -> None:
    """The lab's H200 says 'not supported' for NVLink: None everywhere is no finding."""
    fields = {**BUSY, **LINK_OK, "nvlink_links_down": None, "nvlink_crc_errors": None, "fabric_state": None}
    assert both_ways(series(600, 5, fields)) == []


@pytest.mark.parametrize(("state", "status", "fires"), [(2, 0, True), (1, 0, True), (3, 5, True), (3, 0, False)])
def test_fabric(state: int, status: int, fires: bool) -> None:
    found = both_ways(series(120, 5, {**BUSY, **LINK_OK, "fabric_state": state, "fabric_status": status}))
    assert [(f.rule, f.severity) for f in found] == ([("fabric_not_ready", Severity.UNHEALTHY)] if fires else [])
