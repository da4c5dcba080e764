"""Which of the daemon's GPUs a job may use: the one choice both launch modes make the same way.

torchrun mode takes the usable GPUs in index order; in-place mode sees every GPU with its usability and
its quarantine epoch (gpuwatch.launcher.in_place.GpuView), so it can tell a GPU released since a worker
left from one that never was quarantined.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic and torch are loaded only where a mode needs them
    from gpuwatch.launcher.in_place import GpuView
    from gpuwatch.serving.wire import Gpu


def usable(gpus: Sequence[Gpu]) -> list[Gpu]:
    """The GPUs a job may use: not quarantined and not unhealthy by index."""
    return sorted((g for g in gpus if not g.quarantined and g.state != "unhealthy"), key=lambda g: g.index)


def in_place_views(gpus: Sequence[Gpu]) -> list[GpuView]:
    """Every GPU as in-place mode sees it: usable or not by the same rule, and its quarantine epoch."""
    from gpuwatch.launcher.in_place import GpuView  # torch.distributed: in-place mode only

    ok = {g.uuid for g in usable(gpus)}
    return [GpuView(g.index, g.uuid, g.uuid in ok, g.epoch) for g in gpus]
