"""XID events, judged by the catalog (xid_catalog.py) for `xid_window_s` after they arrive.

* `xid_critical`: any XID the catalog calls unhealthy; the action is the strongest among them.
* `xid_app`: the others (application faults, informational and unknown codes). One application
  fault is the application's problem, not the card's: warning, restart the app.
* `xid_app_repeated`: `xid_app_repeats` application faults in the window point at the card. One
  fault often raises several XIDs at once (13 with 45, one per channel), so faults are counted as
  bursts: an XID within `BURST_S` of the previous one belongs to the same fault.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.health.xid_catalog import XidInfo, lookup
from gpuwatch.model import Action, Finding, GpuEvent, GpuStatic, Severity

CRITICAL = "xid_critical"
APP_REPEATED = "xid_app_repeated"
APP = "xid_app"
RULE_IDS: tuple[str, ...] = (CRITICAL, APP_REPEATED, APP)
BURST_S = 10.0

# From least to most drastic: a finding carries the strongest action of its XIDs.
_ACTION_ORDER = (Action.NONE, Action.RESTART_APP, Action.RESET_GPU, Action.REBOOT, Action.HARDWARE_INSPECTION)

_Judged = tuple[GpuEvent, int, XidInfo]


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    return ()  # events only


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, ()), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    history = evidence.head
    window = cfg.xid_window_s
    events = evidence.events_since(window, "xid")
    if not events:  # the usual tick
        return []
    judged = [(e, e.xid, lookup(e.xid)) for e in events if e.xid is not None]
    critical = [j for j in judged if j[2].severity is Severity.UNHEALTHY]
    other = [j for j in judged if j[2].severity is not Severity.UNHEALTHY]
    app = [j for j in other if j[2].action is Action.RESTART_APP]
    findings = []
    if critical:
        findings.append(_finding(history, CRITICAL, Severity.UNHEALTHY, _strongest(critical), critical, window))
    bursts = _bursts(app)
    if bursts >= cfg.xid_app_repeats:
        reason = f"{bursts} application faults"
        findings.append(_finding(history, APP_REPEATED, Severity.DEGRADED, Action.RESET_GPU, app, window, reason))
    if other:
        warned = any(j[2].severity is Severity.WARNING for j in other)
        severity = Severity.WARNING if warned else Severity.INFO
        findings.append(_finding(history, APP, severity, _strongest(other), other, window))
    return findings


def _finding(
    history: History,
    rule: str,
    severity: Severity,
    action: Action,
    judged: Sequence[_Judged],
    window: float,
    lead: str = "",
) -> Finding:
    # 'XID 79 (GPU has fallen off the bus) ×1, XID 48 (double-bit ECC error) ×2', newest code first
    counts = Counter((xid, info.description) for _, xid, info in reversed(judged))
    listed = ", ".join(f"XID {xid} ({text}) ×{n}" for (xid, text), n in counts.items())
    reason = f"{lead}: {listed}" if lead else listed
    drill = all(event.drill for event, _, _ in judged)
    return finding(history, rule, severity, action, f"{reason} in the last {window:g} s", drill=drill)


def _strongest(judged: Sequence[_Judged]) -> Action:
    return max((info.action for _, _, info in judged), key=_ACTION_ORDER.index)


def _bursts(judged: Sequence[_Judged]) -> int:
    """Faults among `judged`: an XID within BURST_S of the previous one is the same fault."""
    bursts, last = 0, float("-inf")
    for t in sorted(event.t for event, _, _ in judged):
        if t - last > BURST_S:
            bursts += 1
        last = t
    return bursts
