"""An automatic quarantine decided while the state disk is full survives a restart.

Before, it lived in memory only: at shutdown the store still could not take it, and after the
restart the GPU was back in service. Now every quarantine change goes to a journal first (two
copies, each written in place: beside the database and in the runtime dir), and a restart applies
the journal before the first Snapshot, so the GPU is never offered.

The real test fills a real tmpfs under the state dir of a real daemon process (root); the
in-process one makes every database write fail as a full disk does.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.base.slotfile import Mirrored, SlotFile
from gpuwatch.errors import StoreError
from gpuwatch.model import GpuEvent
from gpuwatch.node.store import JOURNAL_NAME, JOURNAL_SLOT_BYTES, Store
from gpuwatch.testing.daemon_process import DaemonProcess, wait_until
from tests.hardening.conftest import tmpfs
from tests.helpers import start_sim_node


@contextlib.contextmanager
def database_full(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every database write of every Store raises what SQLite says on ENOSPC (the journal is not the database)."""

    def enospc(self: Store, *args: object, **kwargs: object) -> None:
        raise StoreError(f"{self.path}: database or disk is full")

    with monkeypatch.context() as patch:
        for name in ("set_quarantine", "clear_quarantine", "add_decision", "sync_findings", "count_auto_quarantine"):
            patch.setattr(Store, name, enospc)
        yield


@pytest.mark.slow
def test_an_automatic_quarantine_on_a_full_disk_survives_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with database_full(monkeypatch):
        node = start_sim_node(tmp_path, gpus=4)
        node.daemon.monitor.handle_events([GpuEvent(node.clock(), 2, node.gpu(2)["uuid"], "ecc_dbe")])
        node.run_for(5)
        assert node.gpu(2)["quarantined"] and node.client.get("/healthz").json()["store_unsaved_changes"] == 1
        node.close()  # the store still cannot take it at shutdown

        again = start_sim_node(tmp_path, gpus=4)
        gpu = again.gpu(2)
        assert gpu["quarantined"] and gpu["quarantine_reason"].startswith("unhealthy: ecc_uncorrectable")
        assert again.client.get("/healthz").json()["status"] == "store_degraded", "still owed to the database"
        assert [i for i in range(4) if again.gpu(i)["quarantined"]] == [2]
    again.run_for(5)  # space is back: the next tick writes it to the database and empties the journal
    assert again.client.get("/healthz").json()["status"] == "ok"
    assert not again.daemon.store.pending
    again.close()
    for journal in (tmp_path / "state" / JOURNAL_NAME, tmp_path / "run" / JOURNAL_NAME):
        journal.unlink()
    third = start_sim_node(tmp_path, gpus=4)
    try:
        assert third.gpu(2)["quarantined"], "now the database holds it"
    finally:
        third.close()


@pytest.mark.slow
def test_a_release_that_the_full_disk_refused_is_not_undone_by_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = start_sim_node(tmp_path, gpus=2)
    assert node.client.post("/v1/gpus/1/quarantine", json={"reason": "x"}, headers=node.auth).status_code == 200
    with database_full(monkeypatch):
        assert node.client.post("/v1/gpus/1/release", json={}, headers=node.auth).status_code == 503
        node.close()
        again = start_sim_node(tmp_path, gpus=2)
        try:
            assert again.gpu(1)["quarantined"] is False, "the database still says quarantined; the journal wins"
        finally:
            again.close()


def test_a_torn_or_foreign_journal_is_never_taken_for_a_quarantine(tmp_path: Path) -> None:
    store = Store(tmp_path / "gpuwatch.db")
    store.close()
    journal = tmp_path / JOURNAL_NAME
    journal.write_bytes(b"\xff" * journal.stat().st_size)  # garbage in both slots: CRCs do not match
    reopened = Store(tmp_path / "gpuwatch.db")
    assert reopened.quarantines() == {} and not reopened.pending
    reopened.close()


def _health(daemon: DaemonProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(daemon.url + "/healthz", timeout=5) as response:
            return response.status, json.loads(response.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["status"]


def _journaled(path: Path) -> list[object]:
    journal = SlotFile(path, JOURNAL_SLOT_BYTES)
    try:
        got = journal.read()
    finally:
        journal.close()
    return json.loads(got[1]) if got else []


def _auto_quarantined(daemon: DaemonProcess, index: int) -> bool:
    gpu = daemon.get(f"/v1/gpus/{index}")
    return bool(gpu["quarantined"]) and "ecc_uncorrectable" in (gpu["quarantine_reason"] or "")


@pytest.mark.slow
def test_a_real_daemon_restarted_on_a_full_state_disk_keeps_the_quarantine(tmp_path: Path) -> None:
    root = tmp_path / "node"
    state = root / "state"
    with tmpfs(state, "4m") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (needs root); the in-process test covers the logic")
        args = ("--sim-gpus", "4", "--interval", "1")
        first = DaemonProcess(root, *args, "--sim-scenario", "ecc_uncorrectable").start()  # GPU 1's DBE at t+10 s
        try:
            filler = state / "filler"
            with filler.open("wb") as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            wait_until("GPU 1 quarantined for its double-bit ECC error", lambda: _auto_quarantined(first, 1), 30)
            assert _health(first) == (503, "store_degraded")
            assert len(_journaled(state / JOURNAL_NAME)) == len(_journaled(root / "run" / JOURNAL_NAME)) == 1
        finally:
            assert first.stop() == 0
        assert "kept in its quarantine.journal, applied at the next start" in first.log_text()

        healthy = ("--sim-scenario", "healthy")  # the same GPUs (same seed), no fault of their own
        for lost in ((), (root / "run" / JOURNAL_NAME,)):  # a reboot empties /run: the copy beside the database holds
            for path in lost:
                path.unlink()
            restarted = DaemonProcess(root, *args, *healthy, name="restarted")
            restarted.ready_path = "/metrics"  # /healthz says 503 store_degraded, rightly
            restarted.start()
            try:
                assert [g["quarantined"] for g in restarted.get("/v1/gpus")["gpus"]] == [False, True, False, False]
                assert _auto_quarantined(restarted, 1)
                assert _health(restarted) == (503, "store_degraded"), "the database still owes it"
            finally:
                restarted.stop()
            assert "quarantine change(s) the database could not take before the restart are in force again" in (
                restarted.log_text()
            )

        filler.unlink()
        recovered = DaemonProcess(root, *args, *healthy, name="recovered").start()
        try:
            wait_until("the database took it", lambda: _health(recovered) == (200, "ok"))
            assert _auto_quarantined(recovered, 1)
        finally:
            recovered.stop()
        assert _journaled(state / JOURNAL_NAME) == _journaled(root / "run" / JOURNAL_NAME) == [], "nothing owed"


def test_a_torn_write_falls_back_to_the_other_slot_and_the_newest_copy_wins(tmp_path: Path) -> None:
    journal = SlotFile(tmp_path / "a", 4096)
    for seq, payload in ((1, b"one"), (2, b"two"), (3, b"three")):
        journal.write(seq, payload)
    assert journal.read() == (3, b"three")
    with (tmp_path / "a").open("r+b") as raw:  # slot 1 (seq 3) torn halfway through its payload
        raw.seek(4096 + 21)
        raw.write(b"\0\0")
    assert journal.read() == (2, b"two")
    journal.close()
    Mirrored([tmp_path / "b"], 4096, "b").write(b"newer")  # seq 1 in b
    stale = SlotFile(tmp_path / "b", 4096)
    assert stale.read() == (1, b"newer")
    stale.close()
    both = Mirrored([tmp_path / "a", tmp_path / "b"], 4096, "both")
    assert (both.seq, both.payload) == (2, b"two"), "a's seq 2 is newer than b's seq 1"
    assert both.write(b"four") and [SlotFile(tmp_path / n, 4096).read() for n in "ab"] == [(3, b"four")] * 2
