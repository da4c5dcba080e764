"""How a drill sees the daemon: the same HTTP API an operator or Alertmanager sees, nothing private,
over the control socket an operator's commands use (gpuwatch.serving.client).

A drill proves the chain a fault goes through (finding, /metrics, quarantine, incident), so it
reads what the outside world reads. Tests plug an in-process client in behind `DrillApi`.

The answers a drill reads come back as the API's models (gpuwatch.serving.wire), imported at the first
call: the daemon imports the drills at start, and pydantic only with its API's first request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from gpuwatch.config import Config
from gpuwatch.serving.client import DaemonClient

if TYPE_CHECKING:  # pydantic loads with the first answer read (see above)
    from gpuwatch.serving import wire


class DrillApi(Protocol):
    """The calls a drill makes; JSON in and out, except /metrics."""

    def get(self, path: str) -> Any: ...

    def text(self, path: str) -> str: ...

    def post(self, path: str, body: dict[str, Any]) -> Any: ...

    def require_control(self) -> None:
        """Raise DaemonError, saying what to do, when the POSTs a drill makes would be refused."""


class HttpApi(DaemonClient):
    """DrillApi over HTTP: the CLI against a running daemon, and scheduled drills against their own daemon."""

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def __init__(self, config: Config, timeout_s: float = 10.0, config_path: str | None = None) -> None:
        super().__init__(config, timeout_s, config_path=config_path)
        self.validate_wait_s = config.validation.timeout_s * 2 + 30  # the GPU test, then dcgmi diag

    def post(self, path: str, body: dict[str, Any]) -> Any:
        # A release with "validate" answers only when the GPU test has run.
        return self.request("POST", path, body, timeout_s=self.validate_wait_s if body.get("validate") else None)

    def text(self, path: str) -> str:
        return self.fetch("GET", path).decode(errors="replace")


def node(api: DrillApi) -> wire.GpuList:
    from gpuwatch.serving import wire

    return wire.read(wire.GpuList, api.get("/v1/gpus"), "GET /v1/gpus")


def gpus(api: DrillApi) -> list[wire.Gpu]:
    return node(api).gpus


def gpu(api: DrillApi, index: int) -> wire.Gpu:
    from gpuwatch.serving import wire

    path = f"/v1/gpus/{index}"
    return wire.read(wire.Gpu, api.get(path), f"GET {path}")


def incidents(api: DrillApi, limit: int | None = None) -> list[wire.Incident]:
    """The daemon's incidents, newest first (its default number of them without `limit`)."""
    from gpuwatch.serving import wire

    path = "/v1/incidents" if limit is None else f"/v1/incidents?limit={limit}"
    return wire.read(wire.Incidents, api.get(path), f"GET {path}").incidents


def inject(api: DrillApi, index: int, body: dict[str, Any]) -> wire.Injection:
    from gpuwatch.serving import wire

    path = f"/v1/gpus/{index}/inject"
    return wire.read(wire.Injection, api.post(path, body), f"POST {path}")


def release(api: DrillApi, index: int, body: dict[str, Any]) -> wire.GpuChanged:
    from gpuwatch.serving import wire

    path = f"/v1/gpus/{index}/release"
    return wire.read(wire.GpuChanged, api.post(path, body), f"POST {path}")


def release_backend(api: DrillApi, duration_s: float) -> wire.BackendReleased:
    """Ask the daemon to let go of its NVML/DCGM handles; findings read as the drill's for `duration_s`."""
    from gpuwatch.serving import wire

    path = "/v1/backend/release"
    return wire.read(wire.BackendReleased, api.post(path, {"duration_s": duration_s}), f"POST {path}")


def reacquire_backend(api: DrillApi) -> wire.BackendReacquired:
    from gpuwatch.serving import wire

    path = "/v1/backend/reacquire"
    return wire.read(wire.BackendReacquired, api.post(path, {}), f"POST {path}")


def pids(g: wire.Gpu) -> list[int]:
    """Every process NVML last listed on the GPU and every trainer that reports from it."""
    listed = g.sample.pids if g.sample else []
    return sorted({*listed, *(t.pid for t in g.trainers)})


def describe_trainers(g: wire.Gpu) -> str:
    return ", ".join(f"rank {t.rank} (pid {t.pid})" for t in g.trainers) or "none"
