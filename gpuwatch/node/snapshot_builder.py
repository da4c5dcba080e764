"""The Snapshot the monitor publishes, built from the parts that hold the node's state.

Readers only ever see a whole Snapshot: every GPU's state, findings, last reading, XIDs and ranks,
and the node's totals, as of one moment. It is built on each publish, so building is on the hot path:
GpuStatus and Snapshot are made by position, a third cheaper than by keyword.

Locking: none of its own. The monitor calls it under its lock, which keeps the parts still while it
reads them; what it returns is immutable and shared without one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuwatch.health import state
from gpuwatch.health.running import RunningState
from gpuwatch.model import Finding, GpuStatic, GpuStatus, Snapshot, TrainerInfo
from gpuwatch.node.drill_overlay import DrillOverlay
from gpuwatch.node.write_behind import StoreWrites
from gpuwatch.node.xid_ledger import XidLedger


@dataclass(frozen=True)
class NodeTotals:
    """The node's figures besides its GPUs: sampling, the kernel log, the node-wide findings."""

    sample_duration_s: float
    sample_errors_total: int
    samples_total: int
    kernel_log_readable: bool | None
    kernel_sxids_total: int
    node_findings: tuple[Finding, ...]


def build_snapshot(
    now: float,
    *,
    backend_name: str,
    statics: Mapping[int, GpuStatic],
    node: state.NodeState,
    running: Mapping[int, RunningState],
    findings: Mapping[int, Sequence[Finding]],
    trainers: tuple[TrainerInfo, ...],
    xids: XidLedger,
    drills: DrillOverlay,
    writes: StoreWrites,
    totals: NodeTotals,
) -> Snapshot:
    """The Snapshot at `now`: each GPU in the state machine's order, its ranks matched by GPU uuid."""
    trainers_by_uuid: dict[str, list[TrainerInfo]] = {}
    for trainer in trainers:
        trainers_by_uuid.setdefault(trainer.gpu_uuid or "", []).append(trainer)
    gpus = []
    for gpu_state in node.gpus:
        index = gpu_state.index
        static = statics[index]
        last_sample, last_error = running[index].last, running[index].last_error
        if last_error and last_sample and last_error.t < last_sample.t:
            last_error = None
        gpus.append(  # by position, in GpuStatus's and Snapshot's field order: a third cheaper than by keyword
            GpuStatus(
                static,
                gpu_state.state,
                tuple(findings.get(index, ())),
                gpu_state.quarantined,
                gpu_state.quarantine_reason,
                gpu_state.quarantined_since,
                gpu_state.epoch,
                last_sample,
                last_error,
                xids.counts(index),
                drills.drilling(index, now),
                tuple(trainers_by_uuid.get(static.uuid, ())),
                xids.kernel_listed(index),
                xids.taken(index),
            )
        )
    return Snapshot(
        now,
        backend_name,
        tuple(gpus),
        totals.sample_duration_s,
        totals.sample_errors_total,
        totals.samples_total,
        node.breaker_tripped,
        node.breaker_refusals,
        trainers,
        writes.error,
        len(writes.quarantines),
        writes.write_errors,
        totals.kernel_log_readable,
        totals.kernel_sxids_total,
        totals.node_findings,
    )
