"""SM clocks and clocks-event ("throttle") reasons.

A low clock alone proves nothing: a healthy H200 at full load runs 1425–1515 of 1980 MHz with
reason 0x4 (SW power cap), and an idle one drops to 345 MHz with 0x1 (docs/hardware-facts.md §A healthy
H200, measured). So:

* each fault bit (HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80) has its
  own rule, degraded when the bit is active for `throttle_duty` of `clock_window_s`;
* `sm_clock_low_unexplained` flags a busy GPU whose clock sits under `clock_low_ratio` of its
  maximum for `level_duty` of the window while no reason bit explains it. Idle, app clocks, SW
  power cap and sync boost are benign explanations; a fault bit is an explanation already reported
  by its own rule, so one cause yields one finding.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, clock_text, finding
from gpuwatch.health.history import History
from gpuwatch.model import (
    REASON_APP_CLOCKS,
    REASON_GPU_IDLE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    REASON_SYNC_BOOST,
    Action,
    Finding,
    GpuSample,
    GpuStatic,
    Severity,
)

# rule id → (reason bit, what the reason text calls it)
THROTTLE_RULES: dict[str, tuple[int, str]] = {
    "clocks_hw_slowdown": (REASON_HW_SLOWDOWN, "HW slowdown"),
    "clocks_sw_thermal": (REASON_SW_THERMAL, "SW thermal slowdown"),
    "clocks_hw_thermal": (REASON_HW_THERMAL, "HW thermal slowdown"),
    "clocks_hw_power_brake": (REASON_HW_POWER_BRAKE, "HW power brake"),
}
LOW_CLOCK_RULE = "sm_clock_low_unexplained"
RULE_IDS: tuple[str, ...] = (LOW_CLOCK_RULE, *THROTTLE_RULES)

# Reason bits that explain a low SM clock: benign ones, and the fault bits that have their own rule.
BENIGN_REASONS = REASON_GPU_IDLE | REASON_APP_CLOCKS | REASON_SW_POWER_CAP | REASON_SYNC_BOOST
EXPLAINS_LOW_CLOCK = BENIGN_REASONS | REASON_HW_SLOWDOWN | REASON_SW_THERMAL | REASON_HW_THERMAL | REASON_HW_POWER_BRAKE


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    window = cfg.clock_window_s
    found = [Condition(rule, "held", window, _has_bit(bit)) for rule, (bit, _) in THROTTLE_RULES.items()]
    max_mhz = static.max_sm_clock_mhz
    if max_mhz:
        found.append(Condition(LOW_CLOCK_RULE, "held", window, lambda s: _low_unexplained(s, cfg, max_mhz)))
    return tuple(found)


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, conditions(history.static, cfg)), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    found = [_low_clock(evidence, cfg)]
    found += [_throttle(evidence, cfg, rule, label) for rule, (_, label) in THROTTLE_RULES.items()]
    return [f for f in found if f is not None]


def _has_bit(bit: int) -> Callable[[GpuSample], bool]:
    return lambda s: bool((s.clocks_event_reasons or 0) & bit)


def _low_unexplained(sample: GpuSample, cfg: RulesConfig, max_mhz: int) -> bool:
    """Busy, clock under `clock_low_ratio` of max, and no reason bit explains it (False when unknown)."""
    util, clock, reasons = sample.util_gpu_pct, sample.sm_clock_mhz, sample.clocks_event_reasons
    if util is None or clock is None or reasons is None:
        return False
    return (
        util >= cfg.clock_busy_util_pct and clock < cfg.clock_low_ratio * max_mhz and not reasons & EXPLAINS_LOW_CLOCK
    )


def _low_clock(evidence: Evidence, cfg: RulesConfig) -> Finding | None:
    history = evidence.head
    max_mhz = history.static.max_sm_clock_mhz
    if not max_mhz:
        return None
    held = evidence.held(LOW_CLOCK_RULE)
    if not held.sustained(cfg.level_duty):
        return None
    clock = clock_text(history.last, max_mhz)
    reason = (
        f"SM clock under {cfg.clock_low_ratio:.0%} of max while busy, unexplained by clocks-event reasons, "
        f"{held.describe()}" + (f"; {clock}" if clock else "")
    )
    return finding(history, LOW_CLOCK_RULE, Severity.DEGRADED, Action.RESET_GPU, reason)


def _throttle(evidence: Evidence, cfg: RulesConfig, rule: str, label: str) -> Finding | None:
    held = evidence.held(rule)
    if not held.sustained(cfg.throttle_duty):
        return None
    history = evidence.head
    clock = clock_text(history.last, history.static.max_sm_clock_mhz)
    reason = f"{label} active {held.describe()}" + (f"; {clock}" if clock else "")
    return finding(history, rule, Severity.DEGRADED, Action.HARDWARE_INSPECTION, reason)
