"""A failing state store never makes a decision disappear (issue 10 item 4).

The full-disk test fills a real tmpfs under the state directory when it can mount one (root),
and otherwise makes every store write raise as a full disk does. Either way: quarantines are
answered 503 (not 200) while they cannot be written, stay in force (API, status.json, the
listeners that signal trainers), /healthz and the metric say degraded, and once space returns
every one is written: after a restart 0 are lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.errors import StoreError
from gpuwatch.model import GpuEvent
from gpuwatch.node.store import QuarantineRecord, Store
from tests.hardening.conftest import tmpfs
from tests.helpers import SimNode, metric_samples, start_sim_node


@contextlib.contextmanager
def real_full_disk(state: Path) -> Iterator[Iterator[None] | None]:
    with tmpfs(state, "2m") as mounted:
        if not mounted:
            yield None
            return

        @contextlib.contextmanager
        def full() -> Iterator[None]:
            filler = state / "filler"
            with filler.open("wb") as out:
                with contextlib.suppress(OSError):
                    while True:
                        out.write(b"\0" * 65536)
                        out.flush()
            try:
                yield
            finally:
                filler.unlink()

        yield full()


@contextlib.contextmanager
def simulated_full_disk(node: SimNode) -> Iterator[None]:
    store = node.daemon.store
    saved = {name: getattr(store, name) for name in ("set_quarantine", "clear_quarantine", "add_decision", "prune")}

    def enospc(*args: object, **kwargs: object) -> None:
        raise StoreError(f"{store.path}: database or disk is full")

    for name in saved:
        setattr(store, name, enospc)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(store, name, method)


def status_json(node: SimNode) -> dict[int, bool]:
    body = json.loads((node.daemon.runtime.path / "status.json").read_text())
    return {g["index"]: g["quarantined"] for g in body["gpus"]}


def degraded_metric(node: SimNode) -> float:
    return metric_samples(node.client.get("/metrics").text, "gpuwatch_store_degraded")[0][1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "simulated"])
def test_full_disk_loses_no_quarantine(tmp_path: Path, how: str) -> None:
    state = tmp_path / "state"
    with contextlib.ExitStack() as stack:
        full_disk = stack.enter_context(real_full_disk(state)) if how == "tmpfs" else None
        if how == "tmpfs" and full_disk is None:
            pytest.skip("cannot mount a tmpfs here (needs root); the simulated case covers the logic")
        node = start_sim_node(tmp_path, gpus=4)
        published: list[str] = []
        node.daemon.monitor.listeners.append(lambda snap, decisions: published.extend(d.kind for d in decisions))
        node.run_for(10)
        with full_disk if full_disk is not None else simulated_full_disk(node):
            for index in (0, 1, 2):
                response = node.client.post(f"/v1/gpus/{index}/quarantine", json={"reason": "disk"}, headers=node.auth)
                assert response.status_code == 503, response.text  # never 200 for what is not on disk
                assert "cannot write" in response.json()["detail"]
            node.daemon.monitor.handle_events([GpuEvent(node.clock(), 3, node.gpu(3)["uuid"], "ecc_dbe")])
            node.run_for(10)  # ticks go on: nothing raises, the automatic quarantine is judged and kept
            node.daemon._last_prune = 0.0
            node.daemon.sample_once()  # the hourly prune fails too, and the watchdog ping still follows
            assert [node.gpu(i)["quarantined"] for i in range(4)] == [True] * 4
            assert status_json(node) == {0: True, 1: True, 2: True, 3: True}, "status.json is not stale"
            assert published.count("quarantine") == 4, "the listeners that signal trainers ran for each"
            health = node.client.get("/healthz")
            assert health.status_code == 503 and health.json()["status"] == "store_degraded"
            assert health.json()["store_unsaved_changes"] == 4
            assert degraded_metric(node) == 1
        node.run_for(5)  # space is back: the next tick writes what was kept
        assert node.client.get("/healthz").json()["status"] == "ok"
        assert degraded_metric(node) == 0
        response = node.client.post("/v1/gpus/0/quarantine", json={"reason": "disk"}, headers=node.auth)
        assert response.status_code == 200
        node.close()
        restarted = start_sim_node(tmp_path, gpus=4)
        try:
            assert [restarted.gpu(i)["quarantined"] for i in range(4)] == [True] * 4, "0 quarantines lost"
        finally:
            restarted.close()


@pytest.mark.slow
def test_a_release_that_cannot_be_written_is_not_lost_either(tmp_path: Path) -> None:
    node = start_sim_node(tmp_path, gpus=2)
    assert node.client.post("/v1/gpus/1/quarantine", json={"reason": "x"}, headers=node.auth).status_code == 200
    with simulated_full_disk(node):
        assert node.client.post("/v1/gpus/1/release", json={}, headers=node.auth).status_code == 503
        assert node.gpu(1)["quarantined"] is False
    node.run_for(5)
    node.close()
    restarted = start_sim_node(tmp_path, gpus=2)
    try:
        assert restarted.gpu(1)["quarantined"] is False
    finally:
        restarted.close()


def record(uuid: str) -> QuarantineRecord:
    return QuarantineRecord(uuid, 0, "bad card", 1.0, False, False, 1)


def corrupt_index(path: Path, index: str) -> None:
    """Overwrite the root page of `index`, as a torn write or a bad sector would."""
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (index,)).fetchone()
    db.close()
    with path.open("r+b") as out:
        out.seek((root - 1) * page_size)
        out.write(b"\xa5" * page_size)


@pytest.mark.parametrize("index", ["finding_open", "sqlite_autoindex_quarantine_1"])
def test_corrupt_database_is_moved_aside_and_its_quarantines_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, index: str
) -> None:
    path = tmp_path / "gpuwatch.db"
    store = Store(path)
    store.set_quarantine(record("GPU-a"))
    store.set_quarantine(record("GPU-b"))
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    corrupt_index(path, index)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.store"):
        reopened = Store(path)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "failed its integrity check" in lines[0] and "2 salvaged" in lines[0], lines
    assert set(reopened.quarantines()) == {"GPU-a", "GPU-b"}
    assert reopened._db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    (kept,) = [k for k in tmp_path.glob("gpuwatch.db.corrupt-*") if not k.name.endswith(("-wal", "-shm"))]
    assert kept.stat().st_size > 0, "the corrupt file is kept for a post-mortem"
    reopened.close()


def test_garbage_database_is_moved_aside_not_emptied(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gpuwatch.db"
    path.write_bytes(b"not a database at all " * 1000)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.store"):
        Store(path).close()
    assert len(caplog.records) == 1 and "integrity check" in caplog.records[0].getMessage()
    (kept,) = [k for k in tmp_path.glob("gpuwatch.db.corrupt-*") if not k.name.endswith(("-wal", "-shm"))]
    assert kept.read_bytes().startswith(b"not a database")


def test_zero_length_database_is_said_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gpuwatch.db"
    path.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="gpuwatch.store"):
        Store(path).close()
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} is empty (0 bytes): starting without persisted quarantines or history"
    ]
