"""The monitor: samples every GPU, takes events at once, judges them, and publishes one immutable Snapshot.

Readers (scrapes, the API, status.json, remediation) only ever see a whole Snapshot; the
sampling thread and the event thread both go through `_judge_and_publish` under one lock.
The monitor is the hub: it holds each GPU's running rule state and the state machine, and owns
the parts that keep the rest, each under its lock: what it reads (`readings`, outside the lock),
XIDs and their de-duplication (`xid_ledger`), drills' injections (`drill_overlay`), findings held
for the operator (`held_findings`), the GPU test before release (`release_gate`), the store's
write-behind queue (`write_behind`), the state kept across a restart (`restore`) and the Snapshot
(`snapshot_builder`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpuwatch.backends.base import Backend
from gpuwatch.config import Config, RulesConfig
from gpuwatch.health import engine, node, state
from gpuwatch.health.running import RunningState
from gpuwatch.model import (
    Action,
    Finding,
    GpuError,
    GpuEvent,
    GpuSample,
    GpuStatic,
    GpuStatus,
    Health,
    Severity,
    Snapshot,
    TrainerInfo,
)
from gpuwatch.node.drill_overlay import DrillOverlay
from gpuwatch.node.held_findings import HELD_RULES, HeldFindings
from gpuwatch.node.injection import Injection
from gpuwatch.node.readings import follow_events, fresh_trainers, sample_all
from gpuwatch.node.release_gate import ReleaseGate, Validator
from gpuwatch.node.restore import restored
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.node.snapshot_builder import NodeTotals, build_snapshot
from gpuwatch.node.store import Store
from gpuwatch.node.write_behind import StoreWrites
from gpuwatch.node.xid_ledger import XidLedger
from gpuwatch.validation import FAILED_RULE, ValidationResult

log = logging.getLogger("gpuwatch.monitor")

Listener = Callable[[Snapshot, list[state.Decision]], None]


class Monitor:
    """Owns each GPU's running rule state, the node state machine and the published Snapshot.

    Each reading is folded into its GPU's RunningState once (health/running.py), so a judgement costs
    the same with a minute or an hour of history behind it.
    """

    def __init__(
        self,
        backend: Backend,
        statics: Iterable[GpuStatic],
        config: Config,
        *,
        store: Store | None = None,
        runtime: RuntimeDir | None = None,
        rules: RulesConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.config = config
        self.rules = rules or config.rules
        self.store = store
        self.runtime = runtime
        self.clock = clock
        self.statics = {s.index: s for s in statics}
        self.listeners: list[Listener] = []
        self.quarantine_gate: state.QuarantineGate | None = None  # asked before each automatic quarantine
        self._lock = threading.RLock()
        self._keep_s = engine.max_window_s(self.rules) + 2 * config.interval_s
        self._running = {
            i: RunningState(s, engine.conditions(s, self.rules), self._keep_s) for i, s in self.statics.items()
        }
        self._xids = XidLedger(self.statics)
        self.kernel_log_readable: bool | None = None  # set by the kernel log follower (daemon.py)
        self.kernel_sxids_total = 0
        self._gate = ReleaseGate(self._lock, self.statics, self._last_pids, clock)
        self._held = HeldFindings(self.statics, store)
        self._findings: dict[int, list[Finding]] = {i: [] for i in self.statics}
        self._drills = DrillOverlay(self._keep_s)
        self._trainers: tuple[TrainerInfo, ...] = ()
        self._last_slow = float("-inf")
        self._samples_total = 0
        self._sample_errors_total = 0
        self._sample_duration_s = 0.0
        self._writes = StoreWrites(store, self.statics)
        self._node = restored(state.initial(sorted(self.statics)), store, self.statics)
        self._node_findings = node.judge(len(self.statics), config.expected_gpus, self.clock(), self.rules)
        self._held.restore()
        self.snapshot = self._build_snapshot(self.clock())

    @property
    def validator(self) -> Validator | None:
        """The active test a burned-in GPU passes before release (daemon.py sets it on live backends)."""
        return self._gate.validator

    @validator.setter
    def validator(self, validator: Validator | None) -> None:
        self._gate.validator = validator

    @property
    def _injections(self) -> dict[int, Injection]:
        """The injections in force, by GPU (the overlay's own dict: a test plants a bad one there)."""
        return self._drills.injections

    # ---------------------------------------------------------------------------------------
    # sampling and events

    def tick(self) -> Snapshot:
        """Sample every GPU once, judge, publish. One GPU failing never stops the others."""
        now = self.clock()
        slow = now - self._last_slow >= self.config.slow_interval_s
        if slow:
            self._last_slow = now
        readings, duration = sample_all(self.backend, self.statics, now, slow=slow)
        return self.judge_readings(readings, duration)

    def judge_readings(self, readings: list[GpuSample | GpuError], duration_s: float = 0.0) -> Snapshot:
        """Record one round of readings (through the injection overlay), judge at their time, publish."""
        now = max([r.t for r in readings], default=self.clock())
        trainers = self._read_trainers(now)
        with self._lock:
            self._sample_duration_s = duration_s
            self._samples_total += 1
            self._sample_errors_total += sum([isinstance(r, GpuError) for r in readings])
            self._trainers = trainers
            for reading in readings:
                self._record(self._drills.overlay(reading, now))
            return self._judge_and_publish(now)

    def handle_events(self, readings: Iterable[GpuEvent | GpuError]) -> Snapshot | None:
        """Judge event-type faults at once, not at the next tick."""
        readings = list(readings)
        trainers = self._read_trainers(self.clock()) if readings else self._trainers
        with self._lock:
            readings = [r for r in readings if r.index in self.statics]
            batch = [r for r in readings if not self._xids.duplicate(r)]
            if not batch:  # only duplicates: the listing (and an XID's pid, from the kernel log) may have grown
                return self._after_decisions([], self.snapshot.t) if readings else None
            self._trainers = trainers  # the ranks as they are now, not at the last tick: a stop needs them
            for reading in batch:
                self._record(reading)
            return self._judge_and_publish(max(max(r.t for r in batch), self.clock()))

    def run_events(self, stop: threading.Event, timeout_s: float = 0.5) -> None:
        """The event thread: wait in the backend's event call and hand each batch on."""
        follow_events(self.backend, self.handle_events, stop, timeout_s)

    def preload(self, readings: Iterable[GpuSample | GpuEvent | GpuError]) -> None:
        """Fold readings into the rules' state without judging or publishing (a bench filling history)."""
        with self._lock:
            for reading in readings:
                if reading.index in self._running:
                    self._record(reading)

    def history_bytes(self) -> dict[int, int]:
        """About how many bytes each GPU's rule state holds (bounded by the windows; see health/running.py)."""
        with self._lock:
            return {index: running.nbytes() for index, running in self._running.items()}

    # ---------------------------------------------------------------------------------------
    # operator actions and drills

    def quarantine(self, index: int, reason: str) -> GpuStatus:
        self._require(index)
        trainers = self._read_trainers(self.clock())
        with self._lock:
            self._trainers = trainers  # the ranks as they are now, not at the last tick: the stop needs them
            node, decisions = state.quarantine(self._node, index, reason, self.clock(), auto=False)
            self._node = node
            return self._status(self._after_decisions(decisions), index)

    def release(self, index: int, reason: str = "operator") -> GpuStatus:
        """An operator's release; it also drops the findings held for the operator (repeat offender, failed test)."""
        self._require(index)
        with self._lock:
            if self._held.drop(index):
                self._findings[index] = [f for f in self._findings.get(index, []) if f.rule not in HELD_RULES]
            node, decisions = state.release(self._node, index, self.clock(), reason)
            self._node = node
            return self._status(self._after_decisions(decisions), index)

    def release_validated(self, index: int, reason: str = "operator") -> tuple[GpuStatus, ValidationResult]:
        """Run the active test first (blocking); release only if it passes, else hold a finding naming the figures."""
        self._require(index)
        refusal = self._gate.claim(index)
        if refusal is not None:
            return self._status(self.snapshot, index), refusal
        result = self._gate.run(index)
        with self._lock:
            self._gate.done(index)
            if result.passed:
                log.warning("GPU %d: validation passed: %s", index, result.reason)
                return self.release(index, f"{reason}; validation passed: {result.reason}"), result
            return self._status(self._validation_failed(index, result), index), result

    def inject(
        self, index: int, fields: Mapping[str, Any], duration_s: float, event: str | None = None, xid: int | None = None
    ) -> Injection:
        """Override `fields` of GPU `index` for `duration_s` and/or inject an event; marks findings as drills."""
        self._require(index)
        injection = self._drills.new(self.statics[index], fields, duration_s, self.clock(), event, xid)
        with self._lock:
            self._drills.put(injection)
        log.warning("drill: injection %s on GPU %d for %.0f s", injection.as_dict(), index, duration_s)
        if injection.event:
            self.handle_events([injection.event])
        return injection

    def injections(self) -> list[Injection]:
        now = self.clock()
        with self._lock:
            return self._drills.in_force(now)

    def end_injection(self, injection_id: int) -> Injection | None:
        """End an injection in force now (a mistyped `for=86400` must not hold a GPU faulty for a day); None if
        there is none by that id. What it caused stays marked as a drill as after any end: while the windows hold it."""
        now = self.clock()
        with self._lock:
            injection = self._drills.end(injection_id, now)
        if injection is None:
            return None
        log.warning("drill: injection %d on GPU %d ended early", injection.id, injection.index)
        return dataclasses.replace(injection, until=now)

    # ---------------------------------------------------------------------------------------
    # the store's write-behind queue

    def unsaved(self, index: int) -> bool:
        """True while a quarantine or release of GPU `index` is in force but not yet durable."""
        static = self.statics.get(index)
        with self._lock:
            return static is not None and static.uuid in self._writes.quarantines

    def flush_store(self) -> int:
        """Retry the queued writes now (at shutdown); the number of quarantine changes still unsaved."""
        with self._lock:
            self._writes.write(self._findings, self.clock())
            return len(self._writes.quarantines)

    # ---------------------------------------------------------------------------------------
    # internals

    def _require(self, index: int) -> None:
        if index not in self.statics:
            raise KeyError(index)

    @staticmethod
    def _status(snapshot: Snapshot, index: int) -> GpuStatus:
        status = snapshot.gpu(index)
        if status is None:
            raise KeyError(index)
        return status

    def _read_trainers(self, now: float) -> tuple[TrainerInfo, ...]:
        return fresh_trainers(self.runtime, now, self.config.trainer.stale_after_s)

    def _last_pids(self, index: int) -> tuple[int, ...]:
        last = self._running[index].last
        return last.pids if last is not None else ()

    def _record(self, reading: GpuSample | GpuEvent | GpuError) -> None:
        if isinstance(reading, GpuEvent) and reading.kind == "xid" and reading.xid is not None:
            self._xids.count(reading, since=self.clock() - self.rules.xid_window_s)
        try:
            self._running[reading.index].add(reading)
        except Exception:  # a value the rules choke on stays on its GPU: the reading is dropped, the others go on
            log.exception("GPU %d: rules failed on a reading; dropped", reading.index)

    def _judge_and_publish(self, now: float) -> Snapshot:
        findings: dict[int, list[Finding]] = {}
        for index, running in self._running.items():
            if not running.seen:
                continue  # never read yet: the state machine keeps it unknown
            drill = self._drills.drilling(index, now)
            try:
                found = engine.judge(running.at(now), self.rules)
            except Exception:  # a bug or odd value on one GPU must not stop judging the others
                log.exception("GPU %d: rules failed; keeping its last findings", index)
                found = list(self._findings.get(index, ()))
            findings[index] = [dataclasses.replace(f, drill=True) if drill else f for f in found]
            findings[index] += self._held.of(index)
        self._findings = findings
        before_release = self.validator is not None and self.config.validation.before_release
        node, decisions = state.step(
            self._node,
            findings,
            now,
            self.config.policy,
            self.quarantine_gate,
            validate=self.statics.keys() if before_release else (),
        )
        self._node = node
        for decision in [d for d in decisions if d.kind == "validate"]:
            self._gate.start(decision.index, now, self._after_auto_validation)
        decisions = [d for d in decisions if d.kind != "validate"]
        self._node, escalated = self._held.escalate_repeat_offenders(
            self._node, decisions, self.config.policy, self._findings
        )
        return self._after_decisions(decisions + escalated, now)

    def _after_auto_validation(self, index: int, result: ValidationResult, now: float) -> None:
        """A burned-in GPU's test ended (passed or failed; under the lock): release it, or hold it for the operator."""
        gpu = next(g for g in self._node.gpus if g.index == index)
        still_due = gpu.quarantined and gpu.quarantine_auto and gpu.state is Health.HEALTHY
        if result.passed and not still_due:  # a new finding or an operator meanwhile: burn-in starts over
            log.warning("GPU %d: validation passed, but the GPU changed meanwhile: not released", index)
        elif result.passed:
            log.warning("GPU %d: validation passed: %s", index, result.reason)
            node, decisions = state.release(self._node, index, now, f"validation passed: {result.reason}", auto=True)
            self._node = node
            self._after_decisions(decisions, now)
        else:
            self._validation_failed(index, result)

    def _validation_failed(self, index: int, result: ValidationResult) -> Snapshot:
        """Hold a finding with the figures: the GPU stays quarantined (no burn-in) until an operator releases it."""
        now = self.clock()
        reason = f"the GPU test failed before release: {result.reason}"
        log.error("GPU %d: %s", index, reason)
        self._held.hold(index, Finding(FAILED_RULE, Severity.DEGRADED, reason, Action.HARDWARE_INSPECTION, now))
        return self._judge_and_publish(now) if self._running[index].seen else self._after_decisions([], now)

    def _after_decisions(self, decisions: list[state.Decision], now: float | None = None) -> Snapshot:
        now = self.clock() if now is None else now
        for decision in decisions:
            self._log(decision)
            self._writes.queue(decision, self._node)
        self._writes.write(self._findings, now)
        snapshot = self._build_snapshot(now)
        self.snapshot = snapshot
        if self.runtime is not None:
            self.runtime.write_status(snapshot)
        for listener in self.listeners:
            try:
                listener(snapshot, decisions)
            except Exception:  # a listener bug must not stop sampling
                log.exception("listener %r failed", listener)
        return snapshot

    def _log(self, decision: state.Decision) -> None:
        level = logging.WARNING if decision.kind in {"quarantine", "refused", "escalate"} else logging.INFO
        log.log(
            level,
            "GPU %d (%s): %s%s: %s",
            decision.index,
            self.statics[decision.index].uuid,
            decision.kind if decision.kind != "state" else f"state {decision.state.value}",
            " [drill]" if decision.drill else "",
            decision.reason,
        )

    def _build_snapshot(self, now: float) -> Snapshot:
        totals = NodeTotals(
            self._sample_duration_s,
            self._sample_errors_total,
            self._samples_total,
            self.kernel_log_readable,
            self.kernel_sxids_total,
            self._node_findings,
        )
        return build_snapshot(
            now,
            backend_name=self.backend.name,
            statics=self.statics,
            node=self._node,
            running=self._running,
            findings=self._findings,
            trainers=self._trainers,
            xids=self._xids,
            drills=self._drills,
            writes=self._writes,
            totals=totals,
        )
