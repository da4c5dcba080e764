"""Thermal margin: a card that lives within a few degrees of its slowdown temperature.

It is not throttling yet (clocks.py reports that), but one warm day or a clogged filter away from
it, and HBM near its maximum is where memory errors grow. The GPU is judged against its slowdown
temperature and HBM against its maximum, both from the card's static facts, for `level_duty` of
`thermal_window_s`.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuSample, GpuStatic, Severity

RULE = "thermal_margin_low"
RULE_IDS: tuple[str, ...] = (RULE,)


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    gpu_limit, mem_limit = static.slowdown_temp_c, static.mem_max_temp_c

    def near(value: int | None, limit: int | None) -> bool:
        return value is not None and limit is not None and value >= limit - cfg.thermal_margin_c

    def hot(sample: GpuSample) -> bool:
        return near(sample.temp_c, gpu_limit) or near(sample.mem_temp_c, mem_limit)

    return (Condition(RULE, "held", cfg.thermal_window_s, hot),)


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, conditions(history.static, cfg)), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    held = evidence.held(RULE)
    if not held.sustained(cfg.level_duty):
        return []
    history = evidence.head
    gpu_limit, mem_limit = history.static.slowdown_temp_c, history.static.mem_max_temp_c
    last = history.last
    now = ""
    if last is not None:
        now = f"; now GPU {last.temp_c} °C (slowdown {gpu_limit} °C), HBM {last.mem_temp_c} °C (max {mem_limit} °C)"
    reason = f"GPU or HBM within {cfg.thermal_margin_c} °C of its limit {held.describe()}{now}"
    return [finding(history, RULE, Severity.DEGRADED, Action.HARDWARE_INSPECTION, reason)]
