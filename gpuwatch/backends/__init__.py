"""Backends by name, imported lazily so `sim` never needs pynvml and `nvml` never needs DCGM."""

from __future__ import annotations

import importlib
import logging

from gpuwatch.backends.base import Backend
from gpuwatch.config import Config
from gpuwatch.errors import BackendUnavailable, ConfigError

log = logging.getLogger("gpuwatch.backends")

BACKENDS: dict[str, str] = {
    "nvml": "gpuwatch.backends.nvml:NvmlBackend",
    "dcgm": "gpuwatch.backends.dcgm:DcgmBackend",
    "sim": "gpuwatch.backends.sim:SimBackend",
    "replay": "gpuwatch.backends.replay:ReplayBackend",
}
AUTO_ORDER = ("nvml", "dcgm")


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name`, or one given as `package.module:Class`."""
    target = BACKENDS.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep:
        choices = ", ".join(["auto", *BACKENDS])
        raise ConfigError(f"backend: unknown backend {name!r} (choose from {choices})")
    cls: type[Backend] = getattr(importlib.import_module(module_name), attr)
    return cls


def open_backend(config: Config) -> tuple[Backend, tuple]:
    """Construct and open the configured backend; `auto` tries NVML then DCGM, never sim.

    Raises:
        BackendUnavailable: with one line that names `--backend sim` when auto finds no GPU.
    """
    if config.backend != "auto":
        backend = backend_class(config.backend)(config)
        return backend, backend.open()
    reasons = []
    for name in AUTO_ORDER:
        backend = backend_class(name)(config)
        try:
            return backend, backend.open()
        except BackendUnavailable as exc:
            reasons.append(f"{name}: {exc}")
            log.debug("backend %s unavailable: %s", name, exc)
    raise BackendUnavailable(
        "no NVIDIA GPU found (" + "; ".join(reasons) + "); on a machine without GPUs run with --backend sim"
    )
