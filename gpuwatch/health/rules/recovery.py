"""The driver's own verdict: NVML's GPU recovery action (field 230, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).

The driver knows what it needs better than a catalog of XIDs does, so a non-zero action is an
unhealthy finding whose action is the driver's. This module is listed first in the engine, so on a
tie in severity (an XID 79 says reboot, the driver says reset) the driver's action is the GPU's
suggested one. Judged on the latest sample: it is a standing verdict, not a trend. 0 and None
(not supported: older drivers) are silence.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuStatic, Severity

RECOVERY_ACTION = "gpu_recovery_action"
RULE_IDS: tuple[str, ...] = (RECOVERY_ACTION,)

# ref. nvml.h nvmlDeviceGpuRecoveryAction_t: NONE 0, GPU_RESET 1, NODE_REBOOT 2, DRAIN_P2P 3,
# DRAIN_AND_RESET 4 (newer headers add BUS_RESET, SYSTEM_REBOOT, RECOVER_IMEX_DOMAIN).
ACTIONS: dict[int, tuple[str, Action]] = {
    1: ("GPU reset", Action.RESET_GPU),
    2: ("node reboot", Action.REBOOT),
    3: ("drain peer-to-peer traffic", Action.RESET_GPU),
    4: ("drain and reset", Action.RESET_GPU),
}


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    return ()  # the latest sample only


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over `history`."""
    return judge(Windowed(history, ()), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    last = evidence.head.last
    if last is None or not last.recovery_action:
        return []
    code = last.recovery_action
    name, action = ACTIONS.get(code, (f"unknown action {code}", Action.REBOOT))
    reason = f"the driver asks for recovery: {name} (NVML recovery action {code})"
    return [finding(evidence.head, RECOVERY_ACTION, Severity.UNHEALTHY, action, reason)]
