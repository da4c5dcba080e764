"""What the link learns from torch when the program imported it, and the one thing it does to it (abort).

torch is never imported here: each function looks it up in sys.modules, so a trainer on another
framework can use the link too (the fields stay null, or come from CUDA_VISIBLE_DEVICES).
Locking: none; these functions keep no state (the abort runs on the link's thread, the rest anywhere).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from gpuwatch.trainer.contract import AllocatorFigures

log = logging.getLogger("gpuwatch.trainer")


def torch_cuda_device(local_rank: int) -> int | None:
    """This rank's CUDA device index when the program imported torch and CUDA is there, else None.

    LOCAL_RANK when that many devices are visible (the torchrun convention), else the current
    device (one device per worker, as with --virtual-local-rank or a CUDA_VISIBLE_DEVICES shim).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    device = local_rank if local_rank < torch.cuda.device_count() else torch.cuda.current_device()
    return int(device)


def gpu_uuid(cuda_device: int | None, local_rank: int) -> str | None:
    """The UUID of this rank's GPU as NVML spells it ("GPU-…"), from torch or CUDA_VISIBLE_DEVICES."""
    torch = sys.modules.get("torch")
    if torch is not None and cuda_device is not None:
        try:
            uuid = str(torch.cuda.get_device_properties(cuda_device).uuid)
        except (RuntimeError, AttributeError) as exc:
            log.debug("no GPU uuid from torch: %s", exc)
        else:
            return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if not entries or not all(e.startswith("GPU-") for e in entries):
        return None
    if len(entries) == 1:  # one GPU per worker: whatever LOCAL_RANK is, that one is ours
        return entries[0]
    return entries[local_rank] if local_rank < len(entries) else None


def memory_stats(cuda_device: int | None) -> AllocatorFigures:
    """The caching allocator's counters for the device; all null without torch or before CUDA is up."""
    torch = sys.modules.get("torch")
    stats: dict[str, Any] = {}
    if torch is not None and cuda_device is not None and torch.cuda.is_initialized():
        try:
            stats = torch.cuda.memory_stats(cuda_device)
        except RuntimeError as exc:
            log.debug("torch.cuda.memory_stats failed: %s", exc)
    return {
        "reserved_bytes": stats.get("reserved_bytes.all.current"),
        "allocated_bytes": stats.get("allocated_bytes.all.current"),
        "inactive_split_bytes": stats.get("inactive_split_bytes.all.current"),
        "num_alloc_retries": stats.get("num_alloc_retries"),
        "num_ooms": stats.get("num_ooms"),
    }


def abort_default_process_group() -> None:
    """Make the main thread's blocked collective fail: NCCL can be aborted from another thread; gloo cannot."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if torch is None or dist is None or not dist.is_available() or not dist.is_initialized():
        log.warning("no process group to abort")
        return
    backend = str(dist.get_backend())
    if "nccl" not in backend:
        log.warning(
            "%s process groups cannot be aborted (torch %s): the blocked collective ends at the process "
            "group's timeout (init_process_group(timeout=...))",
            backend, torch.__version__,
        )  # fmt: skip
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:  # best effort: the watchdog's timeout remains
        log.error("aborting the %s process group failed: %s", backend, exc)
