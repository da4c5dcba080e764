"""row_remap.py: a pending remap needs a reset; a failed one, the vendor."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health.rules import row_remap
from gpuwatch.model import Action, Severity

from .helpers import history, sample

CFG = RulesConfig()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"remapped_pending": 1, "remapped_cor": 1}, [("row_remap_pending", Action.RESET_GPU)]),
        ({"remapped_failure": 1}, [("row_remap_failure", Action.HARDWARE_INSPECTION)]),
        (
            {"remapped_pending": 1, "remapped_failure": 1},
            [("row_remap_pending", Action.RESET_GPU), ("row_remap_failure", Action.HARDWARE_INSPECTION)],
        ),
        # must not fire: rows remapped earlier and done, or not supported
        ({"remapped_cor": 3, "remapped_unc": 1}, []),
        ({"remapped_pending": None, "remapped_failure": None}, []),
    ],
)
def test_latest_flags(fields: dict[str, Any], expected: list[tuple[str, Action]]) -> None:
    found = row_remap.evaluate(history([sample(0), sample(30, **fields)]), CFG)
    assert [(f.rule, f.action) for f in found] == expected
    assert all(f.severity is Severity.UNHEALTHY for f in found)


def test_cleared_by_reset() -> None:
    samples = [sample(0, remapped_pending=1), sample(30, remapped_pending=0, remapped_cor=1)]
    assert row_remap.evaluate(history(samples), CFG) == []


def test_no_samples() -> None:
    assert row_remap.evaluate(history([]), CFG) == []
