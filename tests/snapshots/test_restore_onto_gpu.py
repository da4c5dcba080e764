"""A CUDA job's relaunch takes its host snapshot straight onto its GPU (restore's device path), a CPU job
onto the CPU: the example trainer and ShardedJob ask for the right device. The GPU itself is a fake here
(the device path runs on a GPU machine: tests/snapshots/test_gpu.py, python -m gpuwatch.bench.snapshot_cost)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from gpuwatch.examples import trainer as example  # noqa: E402
from gpuwatch.inplace import sharded  # noqa: E402
from gpuwatch.inplace.engine import Group  # noqa: E402


class _Snap:
    """Records the device each restore was asked for; there is nothing to restore."""

    def __init__(self) -> None:
        self.devices: list[Any] = []

    def resume(self, checkpoint_dir: Any, *, like_state: Any = None, device: Any = None) -> None:
        self.devices.append(device)

    def restore(self, *, like_state: Any = None, at_least: Any = None, device: Any = None) -> None:
        self.devices.append(device)


@pytest.mark.parametrize(("device", "asked"), [("cuda:0", "cuda:0"), ("cpu", None)])
def test_the_example_trainer_restores_onto_its_own_device(tmp_path: Path, device: str, asked: str | None) -> None:
    net = torch.nn.Linear(2, 1)
    snap = _Snap()
    resumed = example._resume(tmp_path, net, torch.optim.SGD(net.parameters(), lr=0.1), 0, snap, torch.device(device))
    assert resumed == (None, None)
    assert snap.devices == [torch.device(asked) if asked else None]


@pytest.mark.parametrize(("device", "asked"), [("cuda:0", "cuda:0"), ("cpu", None)])
def test_a_sharded_job_restores_onto_its_own_device(
    monkeypatch: pytest.MonkeyPatch, device: str, asked: str | None
) -> None:
    snap = _Snap()
    net = torch.nn.Linear(2, 1)
    source = sharded.SnapshotRollback(net, torch.optim.SGD(net.parameters(), lr=0.1), every=1)
    source.snapshot = snap  # type: ignore[assignment]
    monkeypatch.setattr(sharded.dist, "all_reduce", lambda tensor, op=None: None)  # one rank without state
    monkeypatch.setattr(sharded.dist, "broadcast", lambda tensor, src: None)
    snap.wait = lambda: None  # type: ignore[attr-defined]
    snap.resumed_from = lambda step: None  # type: ignore[attr-defined]
    snap.snapshot_now = lambda step: True  # type: ignore[attr-defined]
    real = torch.tensor  # the step agreement's tensor stays on the CPU: there is no GPU here
    monkeypatch.setattr(sharded.torch, "tensor", lambda data, **kw: real(data, dtype=kw.get("dtype")))
    source._bring_back(Group(0, 1, 1, None, torch.device(device)))
    assert snap.devices == [torch.device(asked) if asked else None]
