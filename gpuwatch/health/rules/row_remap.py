"""Row remapping (H100/H200 replace failing HBM rows instead of retiring pages).

Both are flags of the latest reading, cleared only by a GPU reset or never: a pending remap
"will happen at the next GPU reset", so the card must be reset before it is trusted; a remap
failure means the bank ran out of spare rows, an RMA case (docs/hardware-facts.md §Row remapping; NVSentinel maps
DCGM_FR_PENDING_ROW_REMAP to RESET_GPU and DCGM_FR_ROW_REMAP_FAILURE to field diagnostics).
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuStatic, Severity

PENDING = "row_remap_pending"
FAILURE = "row_remap_failure"
RULE_IDS: tuple[str, ...] = (PENDING, FAILURE)


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    return ()  # the latest sample only


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over `history`."""
    return judge(Windowed(history, ()), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    history = evidence.head
    last = history.last
    if last is None:
        return []
    rows = f"{last.remapped_unc or 0} uncorrectable and {last.remapped_cor or 0} correctable rows remapped"
    findings = []
    if last.remapped_pending:
        reason = f"a row remap is pending until the next GPU reset ({rows})"
        findings.append(finding(history, PENDING, Severity.UNHEALTHY, Action.RESET_GPU, reason))
    if last.remapped_failure:
        reason = f"a row remapping failed, the memory has no spare row for a bad one ({rows})"
        findings.append(finding(history, FAILURE, Severity.UNHEALTHY, Action.HARDWARE_INSPECTION, reason))
    return findings
