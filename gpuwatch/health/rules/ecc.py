"""ECC errors: any new uncorrectable (double-bit) error condemns the card; correctable ones only by rate.

Counters are judged by their growth within `ecc_window_s` (see `evidence.growth`): errors the GPU
carried before the daemon started watching, or that are older than the window, do not count. Once
a DBE ages out of the window, a pending row remap (row_remap.py) or XID 48 (xid.py) still holds
the card until it is reset.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuStatic, Severity

UNCORRECTABLE = "ecc_uncorrectable"
CORRECTABLE_RATE = "ecc_correctable_rate"
RULE_IDS: tuple[str, ...] = (UNCORRECTABLE, CORRECTABLE_RATE)


COUNTERS = ("ecc_dbe_volatile", "ecc_dbe_aggregate", "ecc_sbe_volatile", "ecc_sbe_aggregate")


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    return tuple(Condition(counter, "growth", cfg.ecc_window_s) for counter in COUNTERS)


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, conditions(history.static, cfg)), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    found = [_uncorrectable(evidence, cfg), _correctable_rate(evidence, cfg)]
    return [f for f in found if f is not None]


def _uncorrectable(evidence: Evidence, cfg: RulesConfig) -> Finding | None:
    window = cfg.ecc_window_s
    counted = max(evidence.growth("ecc_dbe_volatile"), evidence.growth("ecc_dbe_aggregate"))
    events = evidence.events_since(window, "ecc_dbe")
    if not counted and not events:
        return None
    reason = f"{max(counted, len(events))} new uncorrectable (double-bit) ECC error(s) in the last {window:g} s"
    drill = not counted and all(e.drill for e in events)
    return finding(evidence.head, UNCORRECTABLE, Severity.UNHEALTHY, Action.RESET_GPU, reason, drill=drill)


def _correctable_rate(evidence: Evidence, cfg: RulesConfig) -> Finding | None:
    window = cfg.ecc_window_s
    counted = max(evidence.growth("ecc_sbe_volatile"), evidence.growth("ecc_sbe_aggregate"))
    events = evidence.events_since(window, "ecc_sbe")
    total = max(counted, len(events))
    # The limit is per hour; over the whole window, so a daemon that just started needs the full count.
    if total <= cfg.ecc_sbe_per_hour * window / 3600.0:
        return None
    reason = (
        f"{total} correctable (single-bit) ECC errors in the last {window:g} s "
        f"(limit {cfg.ecc_sbe_per_hour:g} per hour)"
    )
    drill = not counted and all(e.drill for e in events)
    return finding(evidence.head, CORRECTABLE_RATE, Severity.DEGRADED, Action.NONE, reason, drill=drill)
