"""engine.py: every rule over one history; the real healthy H200 trace never flags; faults flag at any interval."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health import engine
from gpuwatch.model import GpuSample, GpuStatic

from .helpers import BUSY, bad, error, event, history, rolling, rules, series

CFG = RulesConfig()
STABLE_IDS = {
    "sm_clock_low_unexplained",
    "clocks_hw_slowdown",
    "clocks_hw_thermal",
    "clocks_hw_power_brake",
    "clocks_sw_thermal",
    "power_unstable",
    "ecc_uncorrectable",
    "ecc_correctable_rate",
    "row_remap_pending",
    "row_remap_failure",
    "xid_critical",
    "xid_app_repeated",
    "xid_app",
    "thermal_margin_low",
    "gpu_lost",
    "gpu_reset_required",
    "gpu_read_error",
    "gpu_recovery_action",
    "pcie_link_degraded",
    "pcie_error_rate",
    "nvlink_down",
    "nvlink_error_rate",
    "fabric_not_ready",
}


def test_rule_ids_are_the_stable_ones() -> None:
    assert set(engine.ALL_RULE_IDS) == STABLE_IDS
    assert len(engine.ALL_RULE_IDS) == len(STABLE_IDS)


def test_findings_carry_their_modules_ids() -> None:
    """Every module reports only the ids it declares (fed one history that trips nearly everything)."""
    samples = series(
        600,
        1.0,
        lambda t: {
            **BUSY,
            "sm_clock_mhz": 500 if t % 2 else 1455,
            "clocks_event_reasons": 0xE8,
            "power_w": 120.0 if t % 2 else 690.0,
            "temp_c": 88,
            "ecc_dbe_volatile": int(t > 300),
            "ecc_sbe_volatile": int(t * 50),
            "remapped_pending": 1,
            "remapped_failure": 1,
            "recovery_action": 1,
            "fabric_state": 1,
        },
    )
    events = [event(590, xid=79), event(591, xid=31)]
    errors = [error(601, "gpu_lost"), error(602, "unknown"), error(603, "unknown")]
    h = history(samples, now=603, events=events, errors=errors)
    for module in engine.RULE_MODULES:
        found = module.evaluate(h, CFG)
        assert found, module.__name__
        assert rules(found) <= set(module.RULE_IDS)


def test_disabled_by_rule_id_or_module() -> None:
    h = history(series(120, 1.0, {**BUSY, "temp_c": 88, "remapped_pending": 1}))
    assert rules(engine.evaluate(h, CFG)) == {"thermal_margin_low", "row_remap_pending"}
    assert rules(engine.evaluate(h, replace(CFG, disabled=("thermal_margin_low",)))) == {"row_remap_pending"}
    assert rules(engine.evaluate(h, replace(CFG, disabled=("row_remap",)))) == {"thermal_margin_low"}


def test_max_window_covers_every_rule() -> None:
    assert engine.max_window_s(CFG) == 3600.0
    short = replace(CFG, ecc_window_s=60.0, xid_window_s=60.0, link_error_window_s=60.0)
    assert engine.max_window_s(short) == 120.0


def test_empty_history_finds_nothing() -> None:
    assert engine.evaluate(history([]), CFG) == []


def test_healthy_h200_trace_never_flags(healthy_trace: tuple[GpuStatic, list[GpuSample]]) -> None:
    """The real H200 (idle, capped full load, bursts, copies, light kernels): nothing degraded at any point."""
    static, samples = healthy_trace
    assert len(samples) == 240
    for h in rolling(samples, CFG, static):
        assert bad(engine.evaluate(h, CFG)) == [], h.now


def test_healthy_h200_trace_never_flags_with_short_windows(healthy_trace: tuple[GpuStatic, list[GpuSample]]) -> None:
    """The sim's fast scenarios shorten the clock and thermal windows to 30 s; still nothing."""
    static, samples = healthy_trace
    fast = replace(CFG, clock_window_s=30.0, thermal_window_s=30.0)
    for h in rolling(samples, fast, static):
        assert bad(engine.evaluate(h, fast)) == [], h.now


FAULTS: list[tuple[str, dict[str, Any]]] = [
    ("sm_clock_low_unexplained", {"sm_clock_mhz": 500, "power_w": 250.0, "clocks_event_reasons": 0}),
    ("clocks_hw_slowdown", {"sm_clock_mhz": 600, "power_w": 300.0, "clocks_event_reasons": 0x8}),
    ("clocks_hw_thermal", {"sm_clock_mhz": 750, "power_w": 350.0, "clocks_event_reasons": 0x40}),
    ("clocks_hw_power_brake", {"sm_clock_mhz": 600, "power_w": 250.0, "clocks_event_reasons": 0x80}),
    ("clocks_sw_thermal", {"sm_clock_mhz": 1100, "power_w": 500.0, "clocks_event_reasons": 0x20}),
    ("thermal_margin_low", {"temp_c": 87}),
    ("row_remap_pending", {"remapped_pending": 1}),
]


@pytest.mark.parametrize(("rule", "fault"), FAULTS, ids=[r for r, _ in FAULTS])
@pytest.mark.parametrize("interval_s", [1.0, 30.0])
def test_same_fault_flagged_at_1s_and_30s(rule: str, fault: dict[str, Any], interval_s: float) -> None:
    """Healthy for 5 minutes, then the fault for 3: quiet before it, flagged by its end, at either interval."""
    samples = series(480, interval_s, lambda t: {**BUSY, **fault} if t >= 300 else BUSY)
    flagged_at = None
    for h in rolling(samples, CFG):
        found = rules(bad(engine.evaluate(h, CFG)))
        if h.now - samples[0].t < 300:
            assert found == set()
        elif rule in found and flagged_at is None:
            flagged_at = h.now - samples[0].t - 300
    assert flagged_at is not None
    assert flagged_at <= 60.0
