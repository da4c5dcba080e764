"""The Backend protocol: what every source of GPU readings (nvml, dcgm, sim, replay) provides.

A backend only reads hardware (or pretends to). It never judges health and never raises
a vendor exception: failures become `gpuwatch.errors` types at this boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, runtime_checkable

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


# Optional capabilities: a backend has one when isinstance(backend, Capability) holds.


@runtime_checkable
class Releasable(Protocol):
    """A backend that can let go of its library for a GPU reset and open it again (nvml, dcgm)."""

    def release_handles(self) -> None: ...

    def reacquire(self) -> tuple[GpuStatic, ...]:
        """Raises BackendError when the library or a GPU does not come back."""
        ...


@runtime_checkable
class KernelLogAware(Protocol):
    """A backend whose own XID events can stand down where the kernel log delivers each XID (nvml)."""

    def kernel_log_covers(self, indices: Collection[int]) -> None:
        """The GPUs the kernel log maps and follows; said before the event thread's first wait."""
        ...


class Scenario(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def rules_overrides(self) -> Mapping[str, Any]:
        """Shortened rule windows, so a demo shows its fault within minutes."""
        ...

    @property
    def judged_by_s(self) -> float:
        """How long `check` must sample to see the fault."""
        ...


@runtime_checkable
class Scripted(Protocol):
    """A backend that plays a scenario (sim) on a clock the caller may replace with simulated time."""

    clock: Callable[[], float]

    @property
    def scenario(self) -> Scenario: ...
