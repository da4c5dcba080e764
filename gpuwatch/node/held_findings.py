"""Findings held until an operator releases the GPU: a repeat offender's, and a failed GPU test's.

The rules' findings come and go with the readings; these stay, in memory and in the store (so a
restart keeps them), until the operator's release drops them. A GPU quarantined automatically for the
`policy.repeat_quarantines`-th time within `policy.repeat_window_s` is held for hardware inspection here.

Locking: none of its own. Only the monitor calls it, always under the monitor's lock (the constructor
and `restore` before any thread starts).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, MutableMapping

from gpuwatch.config import PolicyConfig
from gpuwatch.errors import StoreError
from gpuwatch.health import state
from gpuwatch.model import Action, Finding, GpuStatic, Severity
from gpuwatch.node.store import Store
from gpuwatch.validation import FAILED_RULE

REPEAT_RULE = "repeat_offender"
HELD_RULES = (REPEAT_RULE, FAILED_RULE)

log = logging.getLogger("gpuwatch.monitor")


class HeldFindings:
    """Each GPU's held findings, by rule, mirrored to the store."""

    def __init__(self, statics: Mapping[int, GpuStatic], store: Store | None) -> None:
        self.statics = statics
        self.store = store
        self._held: dict[int, dict[str, Finding]] = {i: {} for i in statics}

    def of(self, index: int) -> Iterable[Finding]:
        return self._held[index].values()

    def hold(self, index: int, finding: Finding) -> Finding:
        """Hold `finding` on GPU `index` (a store that refuses is logged: it stays held in memory); the held one."""
        static = self.statics[index]
        finding = dataclasses.replace(finding, index=index, uuid=static.uuid)
        self._held[index][finding.rule] = finding
        if self.store is not None:
            try:
                self.store.hold_finding(static.uuid, finding)
            except StoreError as exc:
                log.error("cannot store the held finding %s of GPU %d: %s", finding.rule, index, exc)
        return finding

    def drop(self, index: int) -> bool:
        """Drop GPU `index`'s held findings (an operator's release); False when it held none."""
        if not self._held[index]:
            return False
        self._held[index] = {}
        if self.store is not None:
            try:
                self.store.drop_held_findings(self.statics[index].uuid)
            except StoreError as exc:
                log.error("cannot drop the held findings of GPU %d: %s", index, exc)
        return True

    def restore(self) -> None:
        """Hold again what the store kept from before a restart."""
        if self.store is None:
            return
        held = self.store.held_findings()
        for index, static in self.statics.items():
            for finding in held.get(static.uuid, ()):
                log.warning("GPU %d (%s) still holds %s: %s", index, static.uuid, finding.rule, finding.reason)
                self._held[index][finding.rule] = dataclasses.replace(finding, index=index)

    def escalate_repeat_offenders(
        self,
        node: state.NodeState,
        decisions: list[state.Decision],
        policy: PolicyConfig,
        findings: MutableMapping[int, list[Finding]],
    ) -> tuple[state.NodeState, list[state.Decision]]:
        """An automatic quarantine that is the uuid's `repeat_quarantines`-th within the window: held for inspection.

        The held finding joins `findings` (this round's); the escalations come back after the new node state.
        """
        extra: list[state.Decision] = []
        for decision in decisions:
            if self.store is None or decision.kind != "quarantine" or not decision.auto or decision.drill:
                continue
            uuid = self.statics[decision.index].uuid
            try:
                count = self.store.count_auto_quarantine(uuid, decision.t, decision.t - policy.repeat_window_s)
            except StoreError as exc:
                log.error("cannot count quarantines of GPU %d: %s", decision.index, exc)
                continue
            if count < policy.repeat_quarantines:
                continue
            reason = (
                f"quarantined automatically {count} times within {policy.repeat_window_s:g} s (limit "
                f"{policy.repeat_quarantines}): held for hardware inspection until an operator releases it"
            )
            finding = Finding(REPEAT_RULE, Severity.DEGRADED, reason, Action.HARDWARE_INSPECTION, decision.t)
            findings.setdefault(decision.index, []).append(self.hold(decision.index, finding))
            node, held = state.quarantine(node, decision.index, f"repeat offender: {reason}", decision.t)
            extra += [dataclasses.replace(d, kind="escalate") for d in held]
        return node, extra
