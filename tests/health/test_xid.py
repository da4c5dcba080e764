"""xid.py and xid_catalog.py: critical XIDs condemn the card; application XIDs only when repeated."""

from __future__ import annotations

import pytest

from gpuwatch.config import RulesConfig
from gpuwatch.health import xid_catalog
from gpuwatch.health.rules import xid
from gpuwatch.model import Action, Severity

from .helpers import event, history, series

CFG = RulesConfig()
NOW = 1000.0


def judge(*xids_at: tuple[int, float], drill: bool = False) -> dict[str, tuple[Severity, Action]]:
    events = [event(t, xid=code, drill=drill) for code, t in xids_at]
    found = xid.evaluate(history(series(NOW, 30.0), now=NOW, events=events), CFG)
    return {f.rule: (f.severity, f.action) for f in found}


@pytest.mark.parametrize(
    ("xids_at", "expected"),
    [
        ([(79, 990)], {"xid_critical": (Severity.UNHEALTHY, Action.REBOOT)}),
        ([(48, 990)], {"xid_critical": (Severity.UNHEALTHY, Action.RESET_GPU)}),
        ([(48, 980), (79, 990)], {"xid_critical": (Severity.UNHEALTHY, Action.REBOOT)}),  # the strongest action
        ([(92, 980), (79, 990)], {"xid_critical": (Severity.UNHEALTHY, Action.HARDWARE_INSPECTION)}),
        ([(31, 990)], {"xid_app": (Severity.WARNING, Action.RESTART_APP)}),
        ([(63, 990)], {"xid_app": (Severity.INFO, Action.NONE)}),
        ([(999, 990)], {"xid_app": (Severity.WARNING, Action.NONE)}),  # NVML's "unknown Xid"
        ([(12345, 990)], {"xid_app": (Severity.WARNING, Action.NONE)}),
        (
            [(31, 500), (31, 700), (13, 900)],
            {
                "xid_app_repeated": (Severity.DEGRADED, Action.RESET_GPU),
                "xid_app": (Severity.WARNING, Action.RESTART_APP),
            },
        ),
        # one fault raising several XIDs at once is one fault: two bursts are not three faults
        ([(13, 900), (45, 901), (13, 950), (45, 951), (45, 952)], {"xid_app": (Severity.WARNING, Action.RESTART_APP)}),
        # a critical XID persists for the window after it, then is gone
        ([(79, NOW - 599)], {"xid_critical": (Severity.UNHEALTHY, Action.REBOOT)}),
        ([(79, NOW - 601)], {}),
        ([(31, 100), (31, 200), (31, 300)], {}),
    ],
)
def test_events(xids_at: list[tuple[int, float]], expected: dict[str, tuple[Severity, Action]]) -> None:
    assert judge(*xids_at) == expected


def test_reason_lists_codes_and_counts() -> None:
    events = [event(980, xid=48), event(985, xid=48), event(990, xid=79)]
    (found,) = xid.evaluate(history(series(NOW, 30.0), now=NOW, events=events), CFG)
    assert found.reason == (
        "XID 79 (GPU has fallen off the bus) ×1, XID 48 (double-bit ECC error) ×2 in the last 600 s"
    )


def test_drill_events_make_drill_findings() -> None:
    events = [event(990, xid=79, drill=True)]
    (found,) = xid.evaluate(history(series(NOW, 30.0), now=NOW, events=events), CFG)
    assert found.drill
    events.append(event(995, xid=48))
    (found,) = xid.evaluate(history(series(NOW, 30.0), now=NOW, events=events), CFG)
    assert not found.drill


def test_other_events_are_not_xids() -> None:
    events = [event(990, kind="ecc_dbe"), event(991, kind="xid", xid=None)]
    assert xid.evaluate(history(series(NOW, 30.0), now=NOW, events=events), CFG) == []


@pytest.mark.parametrize("code", [48, 79, 92, 94, 95, 119, 120, 154])
def test_catalog_critical(code: int) -> None:
    assert xid_catalog.lookup(code).severity is Severity.UNHEALTHY


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_catalog_application(code: int) -> None:
    assert xid_catalog.lookup(code)[:2] == (Severity.WARNING, Action.RESTART_APP)


def test_catalog_severities_have_rule_ids() -> None:
    """Every catalog entry lands in xid_critical (unhealthy) or xid_app (info, warning)."""
    severities = {info.severity for info in xid_catalog.CATALOG.values()}
    assert severities <= {Severity.UNHEALTHY, Severity.WARNING, Severity.INFO}
    assert xid_catalog.lookup(10_000) is xid_catalog.UNKNOWN
