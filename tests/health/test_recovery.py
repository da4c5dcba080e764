"""recovery.py: the driver's recovery action is a finding with the driver's action, outranking the XID catalog."""

from __future__ import annotations

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health import engine
from gpuwatch.health.rules import recovery
from gpuwatch.model import Action, GpuStatic, GpuStatus, Health, Severity

from .helpers import H200, event, history, sample

CFG = RulesConfig()


@pytest.mark.parametrize(
    ("code", "action"),
    [(1, Action.RESET_GPU), (2, Action.REBOOT), (3, Action.RESET_GPU), (4, Action.RESET_GPU), (9, Action.REBOOT)],
)
def test_non_zero_action_is_the_drivers(code: int, action: Action) -> None:
    found = recovery.evaluate(history([sample(0, recovery_action=code)]), CFG)
    assert [(f.rule, f.severity, f.action) for f in found] == [("gpu_recovery_action", Severity.UNHEALTHY, action)]
    assert f"recovery action {code}" in found[0].reason


@pytest.mark.parametrize("code", [0, None])
def test_none_or_unsupported_is_silence(code: int | None) -> None:
    assert recovery.evaluate(history([sample(0, recovery_action=code)]), CFG) == []


def test_cleared_when_the_driver_clears_it() -> None:
    assert recovery.evaluate(history([sample(0, recovery_action=1), sample(30, recovery_action=0)]), CFG) == []


def test_outranks_the_xid_catalogs_guess() -> None:
    """XID 79 says reboot; the driver says a GPU reset will do: the GPU's suggested action is the driver's."""
    hist = history([sample(0, recovery_action=1)], events=[event(0, xid=79)])
    found = engine.evaluate(hist, CFG)
    assert {f.rule for f in found} >= {"gpu_recovery_action", "xid_critical"}
    status = GpuStatus(static=GpuStatic(index=0, uuid=H200.uuid), state=Health.UNHEALTHY, findings=tuple(found))
    assert status.suggested_action is Action.RESET_GPU
