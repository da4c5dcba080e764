"""The Backend protocol: what every source of GPU readings (nvml, dcgm, sim, replay) provides.

A backend only reads hardware (or pretends to). It never judges health and never raises
a vendor exception: failures become `gpuwatch.errors` types at this boundary.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpuwatch.config import Config
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic


@runtime_checkable
class Backend(Protocol):
    """One source of GPU readings. Constructed as `Cls(config)`; nothing is touched until open()."""

    name: str

    def __init__(self, config: Config) -> None: ...

    def open(self) -> tuple[GpuStatic, ...]:
        """Initialise the library and read each GPU's static facts once.

        Raises:
            BackendUnavailable: the library, driver or GPUs are not there.
        """
        ...

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        """Read one GPU. `slow` also reads the costly fields (PCIe replay, violations, energy).

        Raises:
            GpuReadError: this GPU failed (kind gpu_lost, reset_required or unknown).
        """
        ...

    def wait_events(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        """Block up to `timeout_s` for XID / ECC events; return those that arrived (maybe none)."""
        ...

    def close(self) -> None:
        """Release the library's handles. Safe to call twice."""
        ...
