"""Runs every rule module over one GPU's evidence; the one list of rules the daemon knows.

Modules are listed here explicitly (no import-time registration), in the order their findings
are reported. `RulesConfig.disabled` takes rule ids or module names. `judge` is what the daemon
runs, on its running state; `evaluate` is the windowed reference over a History.
"""

from __future__ import annotations

import functools
from types import ModuleType

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed
from gpuwatch.health.history import History
from gpuwatch.health.rules import clocks, ecc, links, lost, power, recovery, row_remap, thermal, xid
from gpuwatch.model import Finding, GpuStatic

# recovery first: on a tie in severity the driver's own action is the GPU's suggested one (model.GpuStatus).
RULE_MODULES: tuple[ModuleType, ...] = (recovery, lost, xid, ecc, row_remap, clocks, power, thermal, links)
ALL_RULE_IDS: tuple[str, ...] = tuple(rule for module in RULE_MODULES for rule in module.RULE_IDS)


def module_name(module: ModuleType) -> str:
    """The short name `disabled` knows a module by: 'clocks' for gpuwatch.health.rules.clocks."""
    return module.__name__.rsplit(".", 1)[-1]


def known_names() -> frozenset[str]:
    """What `rules.disabled` may name: every rule id and every rule module."""
    return frozenset(ALL_RULE_IDS) | {module_name(module) for module in RULE_MODULES}


def enabled_modules(cfg: RulesConfig) -> tuple[ModuleType, ...]:
    return _enabled(frozenset(cfg.disabled))


@functools.cache
def _enabled(disabled: frozenset[str]) -> tuple[ModuleType, ...]:
    return tuple(module for module in RULE_MODULES if module_name(module) not in disabled)


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    """Every per-sample condition the enabled rules judge on this GPU."""
    return tuple(c for module in enabled_modules(cfg) for c in module.conditions(static, cfg))


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    """Every finding of every enabled rule on this evidence."""
    findings: list[Finding] = []
    for module in enabled_modules(cfg):
        findings += module.judge(evidence, cfg)
    if cfg.disabled and findings:
        disabled = set(cfg.disabled)
        findings = [f for f in findings if f.rule not in disabled]
    return findings


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: every finding of every enabled rule on a rescan of this history."""
    return judge(Windowed(history, conditions(history.static, cfg)), cfg)


def max_window_s(cfg: RulesConfig) -> float:
    """How many seconds of samples, events and errors the longest rule window looks at."""
    return max(
        cfg.clock_window_s,
        cfg.power_window_s,
        cfg.ecc_window_s,
        cfg.xid_window_s,
        cfg.thermal_window_s,
        cfg.link_window_s,
        cfg.link_error_window_s,
    )
