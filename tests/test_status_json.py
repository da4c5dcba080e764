"""status.json: replaced when a GPU's part changes, refreshed every 30 s otherwise (ranks re-read it on change)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import start_sim_node


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
