"""A fake GPU for the snapshot tests that choose a staging buffer by the GPU memory left (this machine has none)."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

GIB = 1 << 30


def free_gib(free: float, total: float = 80) -> Any:
    """torch.cuda.mem_get_info of a GPU of `total` GiB with `free` GiB free."""
    return lambda _device: (int(free * GIB), int(total * GIB))


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A torch whose CUDA allocations are placeholders of their size (the sizes asked for are recorded), whose
    GPU (80 GiB) has 56 GiB free, and with which host memory is never pinned."""
    asked: list[int] = []

    def empty(n: int, **_: Any) -> Any:
        asked.append(n)
        return SimpleNamespace(numel=lambda: n)

    fake = SimpleNamespace(
        empty=empty,
        uint8=torch.uint8,
        cuda=SimpleNamespace(
            device=lambda _: contextlib.nullcontext(),
            OutOfMemoryError=RuntimeError,
            mem_get_info=free_gib(56),
            is_available=lambda: False,
        ),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    return asked
