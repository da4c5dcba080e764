"""The monitor keeps judging when one GPU's read or the store fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.backends.sim import SimBackend
from gpuwatch.base.clock import ManualClock
from gpuwatch.errors import StoreError
from gpuwatch.model import GpuSample
from gpuwatch.node.monitor import Monitor
from gpuwatch.node.store import Store
from tests.helpers import T0, sim_config


class BrokenGpu2(SimBackend):
    """The sim, but reading GPU 2 raises something no backend should (a bug, a vendor surprise)."""

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        if index == 2:
            raise RuntimeError("driver said something odd")
        return super().sample(index, now, slow=slow)


def test_an_unexpected_error_on_one_gpu_hides_no_other(tmp_path: Path) -> None:
    config = sim_config(tmp_path, "healthy", gpus=4)
    clock = ManualClock(T0)
    backend = BrokenGpu2(config, clock=clock)
    monitor = Monitor(backend, backend.open(), config, clock=clock)
    for _ in range(3):
        clock.advance(5)
        snapshot = monitor.tick()
    gpu2 = snapshot.gpu(2)
    assert gpu2 is not None and gpu2.error is not None and gpu2.error.kind == "unknown"
    assert "RuntimeError" in gpu2.error.detail
    assert [g.state.value for g in snapshot.gpus if g.index != 2] == ["healthy"] * 3
    assert gpu2.state.value == "degraded" and [f.rule for f in gpu2.findings] == ["gpu_read_error"]


def test_a_failing_store_does_not_stop_judging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = sim_config(tmp_path, "healthy", gpus=2)
    clock = ManualClock(T0)
    backend = SimBackend(config, clock=clock)
    store = Store(tmp_path / "gpuwatch.db")
    monitor = Monitor(backend, backend.open(), config, store=store, clock=clock)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise StoreError("database or disk is full")

    monkeypatch.setattr(store, "add_decision", full_disk)
    monkeypatch.setattr(store, "sync_findings", full_disk)
    monkeypatch.setattr(store, "set_quarantine", full_disk)
    clock.advance(5)
    monitor.tick()
    status = monitor.quarantine(1, "operator")
    assert status.quarantined is True
    clock.advance(5)
    assert monitor.tick().gpu(1).quarantined is True  # type: ignore[union-attr]
