"""Findings on the node rather than on one GPU: GPUs the node should have that the backend does not list.

A GPU that fell off the bus before the daemon started (the commonest failure at boot) never gets a
GpuStatus, so no per-GPU rule can see it; only the count can. Pure, like every rule: the count seen,
the count expected (config `expected_gpus`, 0 meaning whatever was seen at start) and the time.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.model import Action, Finding, Severity

GPU_MISSING = "gpu_missing"
RULE_IDS: tuple[str, ...] = (GPU_MISSING,)


def judge(seen: int, expected: int, t: float, cfg: RulesConfig) -> tuple[Finding, ...]:
    """`gpu_missing` (unhealthy, on the node) while fewer GPUs are seen than expected; () otherwise.

    The same comparison as the metrics' `gpuwatch_gpus < gpuwatch_gpus_expected`, which the
    GpuwatchFewerGpusThanExpected alert watches.
    """
    if seen >= expected or GPU_MISSING in cfg.disabled:
        return ()
    reason = (
        f"{seen} of the {expected} GPUs this node should have (expected_gpus) are visible: "
        "a GPU fell off the bus or failed to come up at boot"
    )
    return (Finding(GPU_MISSING, Severity.UNHEALTHY, reason, Action.REBOOT, t),)
