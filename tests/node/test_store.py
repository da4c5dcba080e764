"""The SQLite store: quarantines keyed by uuid survive reopening; findings open and close."""

from __future__ import annotations

from pathlib import Path

from gpuwatch.model import Action, Finding, Severity
from gpuwatch.node.store import QuarantineRecord, Store


def test_quarantine_survives_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "gpuwatch.db")
    store.set_quarantine(QuarantineRecord("GPU-a", 1, "ecc", 100.0, True, False, 3))
    store.close()
    reopened = Store(tmp_path / "gpuwatch.db")
    assert reopened.quarantines()["GPU-a"].epoch == 3
    reopened.clear_quarantine("GPU-a")
    assert reopened.quarantines() == {}
    assert reopened.epochs() == {"GPU-a": 3}


def test_findings_open_once_and_close(tmp_path: Path) -> None:
    store = Store(tmp_path / "gpuwatch.db")
    finding = Finding("ecc_uncorrectable", Severity.UNHEALTHY, "1 new DBE", Action.RESET_GPU, 10.0, 0, "GPU-a")
    store.sync_findings("GPU-a", 0, [finding], 10.0)
    store.sync_findings("GPU-a", 0, [finding], 11.0)
    (row,) = store.findings()
    assert row["rule"] == "ecc_uncorrectable" and row["closed"] is None
    store.sync_findings("GPU-a", 0, [], 12.0)
    (row,) = store.findings()
    assert row["closed"] == 12.0
    assert store.prune(older_than=13.0) == 1
    assert store.findings() == []
