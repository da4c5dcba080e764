"""Whether a GPU has room for a replacement while the rank it replaces is still freeing its memory.

A killed rank's exit begins at once, but the kernel and the driver take seconds to free what it held
(2.1 s for a rank with 16 GiB of state and its pinned snapshot slots on one H200): the launcher may
hand its rank to a spare before that, but only where the replacement can allocate as much again
beside it. NVML says the GPU's free memory and what the dying process holds; where NVML does not list
the process (another PID namespace) the bound is everything in use on the GPU. A standby that takes the
rank has already allocated part of that (the model its script built before the join): only the rest
has to fit beside the dying rank.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_nvml: list[Any] = []  # the pynvml module once initialised; empty: not tried yet
_NO_NVML = object()


def room_beside(uuid: str, pid: int, taker: int | None = None) -> bool:
    """True when GPU `uuid` has at least as much memory free as process `pid` holds there (or as is in use
    when NVML does not list it), less what process `taker` (the standby that takes the rank) already holds
    there, or when there is no GPU memory to wait for (no NVML driver, a GPU NVML does not know: a CPU
    job); False when NVML cannot say."""
    nvml = _init()
    if nvml is _NO_NVML:
        return True
    try:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError_NotFound:
            return True
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        held = _held(nvml, handle)
        need = held[pid] if pid in held else memory.total - memory.free
        return bool(memory.free >= need - (held.get(taker, 0) if taker is not None else 0))
    except nvml.NVMLError:
        return False


def held_by(uuid: str, pid: int) -> int:
    """The bytes process `pid` holds on GPU `uuid` as NVML lists it; 0 where NVML cannot say (no NVML, a GPU
    it does not know, the process not listed: another PID namespace)."""
    nvml = _init()
    if nvml is _NO_NVML:
        return 0
    try:
        return int(_held(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid)).get(pid, 0))
    except nvml.NVMLError:
        return 0


def _held(nvml: Any, handle: Any) -> dict[int, int]:
    """pid -> bytes for each process NVML lists on the GPU (0 where it does not say)."""
    return {p.pid: p.usedGpuMemory or 0 for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}


def prepare() -> None:
    """Initialise NVML now (tens of milliseconds, more in a sandbox), so a replacement does not wait for it."""
    _init()


def _init() -> Any:
    with _lock:
        if not _nvml:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml.append(pynvml)
            except Exception:  # no library, no driver: no GPU here
                _nvml.append(_NO_NVML)
        return _nvml[0]
