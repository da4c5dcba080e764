"""lost.py: errors newer than the last good sample; a GPU that reads again is clear."""

from __future__ import annotations

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health.rules import lost
from gpuwatch.model import Action, Severity

from .helpers import error, history, series

CFG = RulesConfig()


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        ([("gpu_lost", 90)], {"gpu_lost": (Severity.UNHEALTHY, Action.REBOOT)}),
        ([("reset_required", 90)], {"gpu_reset_required": (Severity.UNHEALTHY, Action.RESET_GPU)}),
        ([("unknown", 90), ("unknown", 120)], {"gpu_read_error": (Severity.DEGRADED, Action.NONE)}),
        # must not fire: one unexplained failed read is noise
        ([("unknown", 90)], {}),
        # must not fire: errors before the last good sample (the GPU reads fine again)
        ([("gpu_lost", 30), ("unknown", 40), ("unknown", 50)], {}),
        ([], {}),
    ],
)
def test_errors(errors: list[tuple[str, float]], expected: dict[str, tuple[Severity, Action]]) -> None:
    h = history(series(60, 30.0), now=120, errors=[error(t, kind) for kind, t in errors])
    assert {f.rule: (f.severity, f.action) for f in lost.evaluate(h, CFG)} == expected


def test_never_read() -> None:
    h = history([], now=30, errors=[error(0, "gpu_lost"), error(30, "gpu_lost")])
    (found,) = lost.evaluate(h, CFG)
    assert found.rule == "gpu_lost" and "since the daemon started" in found.reason
