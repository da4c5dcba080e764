"""A GPU that cannot be read: fallen off the bus, needing a reset, or failing reads for no named reason.

Judged only on errors newer than the last good sample, so a GPU that reads fine again is clear at
once (the state machine's recovery time still applies). One unexplained failed read is noise
(a timeout under load); `MIN_READ_ERRORS` in a row are a GPU that cannot be watched.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuStatic, Severity

LOST = "gpu_lost"
RESET_REQUIRED = "gpu_reset_required"
READ_ERROR = "gpu_read_error"
RULE_IDS: tuple[str, ...] = (LOST, RESET_REQUIRED, READ_ERROR)
MIN_READ_ERRORS = 2


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    return ()  # read errors only


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, ()), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    history = evidence.head
    errors = evidence.read_errors()
    findings = []
    if lost := errors.counts["gpu_lost"]:
        reason = f"the GPU has fallen off the bus: {lost} failed read(s) since {_since(history)}"
        findings.append(finding(history, LOST, Severity.UNHEALTHY, Action.REBOOT, reason))
    if reset := errors.counts["reset_required"]:
        reason = f"the driver needs a GPU reset: {reset} failed read(s) since {_since(history)}"
        findings.append(finding(history, RESET_REQUIRED, Severity.UNHEALTHY, Action.RESET_GPU, reason))
    unknown = errors.counts["unknown"]
    if unknown >= MIN_READ_ERRORS:
        last_detail = errors.details.get("unknown", "")
        detail = f" ({last_detail})" if last_detail else ""
        reason = f"{unknown} failed reads since {_since(history)}{detail}"
        findings.append(finding(history, READ_ERROR, Severity.DEGRADED, Action.NONE, reason))
    return findings


def _since(history: History) -> str:
    last = history.last
    return "the daemon started" if last is None else f"the last good sample {history.now - last.t:.0f} s ago"
