"""What a restarted monitor starts from: the quarantines and epochs the store kept.

A GPU quarantined before a restart stays quarantined, with its reason, its start and its epoch (the
epoch only ever grows, so a rank never mistakes an old quarantine for a new one).

Locking: none. It runs once, in the monitor's constructor, before any thread can see the monitor.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from gpuwatch.health import state
from gpuwatch.model import GpuStatic
from gpuwatch.node.store import Store

log = logging.getLogger("gpuwatch.monitor")


def restored(node: state.NodeState, store: Store | None, statics: Mapping[int, GpuStatic]) -> state.NodeState:
    """`node` seeded with the quarantines and epochs `store` persisted before a restart."""
    if store is None:
        return node
    records = store.quarantines()
    epochs = store.epochs()
    restored = []
    for gpu_state in node.gpus:
        uuid = statics[gpu_state.index].uuid
        record = records.get(uuid)
        epoch = epochs.get(uuid, 0)
        if record is not None:
            log.warning(
                "GPU %d (%s) stays quarantined from before the restart: %s", gpu_state.index, uuid, record.reason
            )
            gpu_state = dataclasses.replace(
                gpu_state,
                quarantined=True,
                quarantine_reason=record.reason,
                quarantined_since=record.since,
                quarantine_auto=record.auto,
                epoch=record.epoch,
            )
        else:
            gpu_state = dataclasses.replace(gpu_state, epoch=epoch)
        restored.append(gpu_state)
    return dataclasses.replace(node, gpus=tuple(restored))
