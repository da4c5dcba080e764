"""Power instability that nothing benign explains.

Power swings are normal: a healthy 2-rank DDP job on H200s swings 290–682 W (std 42 W) at 100%
utilization as compute and all-reduce phases alternate (docs/hardware-facts.md §A healthy H200,
measured). Spread, variance or a minimum power therefore say nothing about the card. What does: a GPU
kept busy (util ≥ `power_min_util_pct`) whose power collapses far below its limit (<
`power_unstable_drop_ratio` × limit) while its SM clock collapses too (< `clock_low_ratio` × max), with
no benign clocks-event reason (idle, app clocks, SW power cap, sync boost) to explain it. In a healthy
all-reduce phase power falls but the clock rises to its maximum, and a capped or idle card says so with
0x4 or 0x1.

A collapse that holds is `sm_clock_low_unexplained` or a `clocks_*` rule. This rule catches the
intermittent form those duty-based rules miss: the card keeps dropping out and recovering under a
busy load (a power brake that comes and goes counts). It counts falls: a busy sample with the SM
clock at speed followed straight by a collapsed one. A ramp-up from idle is no fall, so bursty jobs
stay quiet, and a card throttled throughout whose power wanders across the line is never at speed,
so it stays the throttle rule's business. It fires on at least `MIN_DROPS` falls within
`power_window_s`. Two falls are visible at a 30 s interval in a 120 s window (5 samples), and at
1 s just the same.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.health.rules.clocks import BENIGN_REASONS
from gpuwatch.model import Action, Finding, GpuSample, GpuStatic, Severity

RULE = "power_unstable"
RULE_IDS: tuple[str, ...] = (RULE,)
MIN_DROPS = 2


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    limit_w, max_mhz = static.power_limit_w, static.max_sm_clock_mhz
    if not limit_w or not max_mhz:
        return ()
    floor_w, floor_mhz = cfg.power_unstable_drop_ratio * limit_w, cfg.clock_low_ratio * max_mhz
    return (Condition(RULE, "falls", cfg.power_window_s, lambda s: _collapsed(s, cfg, floor_w, floor_mhz)),)


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, conditions(history.static, cfg)), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    history = evidence.head
    limit_w, max_mhz = history.static.power_limit_w, history.static.max_sm_clock_mhz
    if not limit_w or not max_mhz:
        return []
    floor_w, floor_mhz = cfg.power_unstable_drop_ratio * limit_w, cfg.clock_low_ratio * max_mhz
    drops = evidence.falls(RULE)
    if drops < MIN_DROPS:
        return []
    reason = (
        f"power fell under {floor_w:.0f} W of its {limit_w:.0f} W limit with the SM clock under "
        f"{floor_mhz:.0f} MHz at ≥{cfg.power_min_util_pct}% utilization, no benign clocks-event reason, "
        f"{drops} times in the last {cfg.power_window_s:g} s"
    )
    return [finding(history, RULE, Severity.DEGRADED, Action.HARDWARE_INSPECTION, reason)]


def _collapsed(sample: GpuSample, cfg: RulesConfig, floor_w: float, floor_mhz: float) -> bool | None:
    """True: collapsed; False: busy with the clock at speed; None: anything else (judges nothing)."""
    util, power, clock, reasons = sample.util_gpu_pct, sample.power_w, sample.sm_clock_mhz, sample.clocks_event_reasons
    if util is None or power is None or clock is None or reasons is None or util < cfg.power_min_util_pct:
        return None
    if clock >= floor_mhz:
        return False
    if power < floor_w and not reasons & BENIGN_REASONS:
        return True
    return None
