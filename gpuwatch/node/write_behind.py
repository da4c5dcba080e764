"""The store's write-behind queue: the monitor's decisions wait here until the database takes them.

A full or read-only disk must never make a decision disappear: it stays in force in memory
(status.json, signals and the API show it), /healthz and gpuwatch_store_degraded say the store is
behind, and every later tick retries until the writes land, oldest first. Quarantine changes wait in
the store's own journal (store.PendingQuarantines), so a restart before the disk recovers keeps them.

Locking: none of its own. Only the monitor calls it, always under the monitor's lock.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from gpuwatch.errors import StoreError
from gpuwatch.health import state
from gpuwatch.model import Finding, GpuStatic
from gpuwatch.node.store import QuarantineRecord, Store

log = logging.getLogger("gpuwatch.monitor")


class StoreWrites:
    """Quarantine changes, decisions and each GPU's findings, queued for the store and written in order."""

    def __init__(self, store: Store | None, statics: Mapping[int, GpuStatic]) -> None:
        self.store = store
        self.statics = statics
        # Writes the store refused (full disk, read-only): in force, journaled (store.py), retried every tick, in order.
        self.quarantines: MutableMapping[str, QuarantineRecord | None] = store.pending if store else {}
        self._decisions: deque[tuple[Any, ...]] = deque(maxlen=10000)
        self._synced: dict[int, frozenset[str]] = {}  # the finding rules last written to the store, per GPU
        self.error = ""  # why the store last refused a write; "" while it takes them
        self.write_errors = 0

    def queue(self, decision: state.Decision, node: state.NodeState) -> None:
        """Line a decision up for the store; `write` writes everything queued, oldest first."""
        if self.store is None:
            return
        static = self.statics[decision.index]
        gpu_state = node.gpus[_position(node, decision.index)]
        if decision.kind in {"quarantine", "escalate"}:
            self.quarantines[static.uuid] = QuarantineRecord(
                static.uuid,
                decision.index,
                gpu_state.quarantine_reason,
                gpu_state.quarantined_since or decision.t,
                decision.auto,
                decision.drill,
                gpu_state.epoch,
            )
        elif decision.kind == "release":
            self.quarantines[static.uuid] = None
        row = (decision.t, decision.index, static.uuid, decision.kind, decision.state.value, decision.reason)
        self._decisions.append((*row, decision.drill))

    def write(self, findings: Mapping[int, Sequence[Finding]], now: float) -> None:
        """Write queued quarantine changes, decisions and `findings`; on failure keep them and say so once."""
        if self.store is None:
            return
        try:
            while self.quarantines:
                uuid, record = next(iter(self.quarantines.items()))
                if record is None:
                    self.store.clear_quarantine(uuid)
                else:
                    self.store.set_quarantine(record)
                del self.quarantines[uuid]
            while self._decisions:
                self.store.add_decision(*self._decisions[0])
                self._decisions.popleft()
            for index, static in self.statics.items():
                self._sync_findings(self.store, index, static.uuid, findings.get(index, ()), now)
        except StoreError as exc:  # a full disk must not stop judging: the Snapshot and status.json still go out
            self.write_errors += 1
            if not self.error:
                log.error(
                    "state store cannot write; %d quarantine change(s) in force and journaled, retried every tick: %s",
                    len(self.quarantines),
                    exc,
                )
            self.error = str(exc) or type(exc).__name__
            return
        if self.error:
            log.warning("state store writes again: every quarantine change is saved")
            self.error = ""

    def _sync_findings(self, store: Store, index: int, uuid: str, found: Sequence[Finding], now: float) -> None:
        """Write a GPU's findings to the store when its set of rules changed (only this monitor writes them)."""
        rules = frozenset(f.rule for f in found)
        if self._synced.get(index) != rules:
            store.sync_findings(uuid, index, list(found), now)
            self._synced[index] = rules


def _position(node: state.NodeState, index: int) -> int:
    for position, gpu_state in enumerate(node.gpus):
        if gpu_state.index == index:
            return position
    raise KeyError(index)
