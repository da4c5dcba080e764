"""status.json: replaced when a GPU's part changes, refreshed every 30 s otherwise (ranks re-read it on change)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import metric_value, start_sim_node
from tests.reporting import FakeRank


def test_status_json_is_replaced_when_a_gpu_changes_and_refreshed_every_30_s(tmp_path: Path) -> None:
    """Ranks re-read status.json whenever it is replaced: an unchanged file is left alone between refreshes."""
    node = start_sim_node(tmp_path, "healthy", gpus=2)
    try:
        status = node.daemon.runtime.path / "status.json"

        def replaced() -> tuple[int, dict[str, Any]]:
            return status.stat().st_ino, json.loads(status.read_bytes())

        first, body = replaced()
        node.run_for(10)  # two samples, nothing changed
        assert replaced() == (first, body)
        node.daemon.monitor.quarantine(1, "bad fan")  # a change goes out at once
        second, body = replaced()
        assert second != first and body["gpus"][1]["quarantined"] is True
        node.run_for(20)
        assert replaced()[0] == second
        node.run_for(10)  # 30 s since the last write: `t` is refreshed although nothing changed
        third, refreshed = replaced()
        assert third != second and refreshed["t"] > body["t"] and refreshed["gpus"] == body["gpus"]
    finally:
        node.close()


def test_a_status_json_that_cannot_be_written_is_counted_and_logged_once_and_stops_still_go_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full or read-only runtime dir: the quarantine still signals the rank, the failure is counted at
    every try and logged once, and the file is written again once it can be."""
    node = start_sim_node(tmp_path, "healthy", gpus=2)
    rank = FakeRank("signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))")
    try:
        node.report(rank, 1, rank=0, step=5, first_step=1)
        node.run_for(5)
        blocker = node.daemon.runtime.path / ".status.json.tmp"
        blocker.mkdir()  # the temp file cannot be opened: the write fails as on a full disk, also as root

        with caplog.at_level(logging.WARNING, logger="gpuwatch.runtime"):
            response = node.client.post("/v1/gpus/1/quarantine", json={"reason": "bad fan"}, headers=node.auth)
            assert response.status_code == 200, response.text
            assert rank.wait(10) == 75, "the stop went out although status.json could not be written"
            node.run_for(15)
            failures = metric_value(node.client.get("/metrics").text, "gpuwatch_runtime_status_write_errors_total")
            assert failures >= 4  # the quarantine's write and one at each of the three samples after it
            status = json.loads((node.daemon.runtime.path / "status.json").read_bytes())
            assert status["gpus"][1]["quarantined"] is False, "the old file stays as it was"

            blocker.rmdir()
            node.run_for(5)
        status = json.loads((node.daemon.runtime.path / "status.json").read_bytes())
        assert status["gpus"][1]["quarantined"] is True
        lines = [r.getMessage() for r in caplog.records if r.name == "gpuwatch.runtime"]
        assert len([line for line in lines if "cannot write" in line]) == 1, lines
        assert lines[-1].endswith("status.json written again")
    finally:
        rank.kill()
        rank.wait()
        node.close()
