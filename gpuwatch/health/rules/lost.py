"""A GPU that cannot be read: fallen off the bus, needing a reset, or failing reads for no named reason.

Judged only on errors newer than the last good sample, so a GPU that reads fine again is clear at
once (the state machine's recovery time still applies). One unexplained failed read is noise
(a timeout under load); `MIN_READ_ERRORS` in a row are a GPU that cannot be watched.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, Severity

LOST = "gpu_lost"
RESET_REQUIRED = "gpu_reset_required"
READ_ERROR = "gpu_read_error"
RULE_IDS: tuple[str, ...] = (LOST, RESET_REQUIRED, READ_ERROR)
MIN_READ_ERRORS = 2


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    last_good = history.last.t if history.last is not None else float("-inf")
    errors = [e for e in history.errors if e.t > last_good]
    findings = []
    lost = [e for e in errors if e.kind == "gpu_lost"]
    if lost:
        reason = f"the GPU has fallen off the bus: {len(lost)} failed read(s) since {_since(history)}"
        findings.append(finding(history, LOST, Severity.UNHEALTHY, Action.REBOOT, reason))
    reset = [e for e in errors if e.kind == "reset_required"]
    if reset:
        reason = f"the driver needs a GPU reset: {len(reset)} failed read(s) since {_since(history)}"
        findings.append(finding(history, RESET_REQUIRED, Severity.UNHEALTHY, Action.RESET_GPU, reason))
    unknown = [e for e in errors if e.kind == "unknown"]
    if len(unknown) >= MIN_READ_ERRORS:
        detail = f" ({unknown[-1].detail})" if unknown[-1].detail else ""
        reason = f"{len(unknown)} failed reads since {_since(history)}{detail}"
        findings.append(finding(history, READ_ERROR, Severity.DEGRADED, Action.NONE, reason))
    return findings


def _since(history: History) -> str:
    last = history.last
    return "the daemon started" if last is None else f"the last good sample {history.now - last.t:.0f} s ago"
