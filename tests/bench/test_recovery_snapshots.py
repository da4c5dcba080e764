"""The mode-by-mode measurement the GPU script and the bench print (recovery_snapshots.py), run small on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuwatch.bench import recovery_snapshots as rs


def test_each_mode_runs_on_one_loop_and_the_rows_say_it_against_the_plain_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWATCH_SNAPSHOT_ROOT", str(tmp_path))
    loop = rs.build(0.001, torch.device("cpu"), batch=4, width=64)
    runs = rs.measure_modes(loop, 24, "modes")
    table = rs.rows(loop.state_bytes / 2**30, runs)
    restore = rs.restore_time(loop, "modes")
    rs.cleanup("modes")

    assert [r["mode"] for r in table] == ["none", "every 8", "every 4", "auto"]
    assert [r["K"] for r in table[:3]] == [None, 8, 4] and table[3]["K"] is not None
    assert all(r["steps"] == 24 and r["snapshot_mode"] in (None, "cpu") for r in table), table
    assert all(r["snapshots"] >= 2 for r in table[1:]), table
    assert table[1]["setup_longest_ms"] is not None and table[2]["setup_longest_ms"] is None  # set up once
    assert table[0]["wall_vs_plain"] == 0 and table[1]["loss_bound_steps"] >= 8
    assert rs.markdown(table).startswith("| GiB | mode |") and rs.markdown(table).count("\n") == len(table) + 1
    assert restore["exact"] is True and restore["restore_s"] > 0
    assert not any(tmp_path.rglob("*.slot*"))  # the slots are gone
