"""The monitor: samples every GPU, takes events at once, judges them, and publishes one immutable Snapshot.

Readers (scrapes, the API, status.json, remediation) only ever see a whole Snapshot; the
sampling thread and the event thread both go through `_judge_and_publish` under one lock.
The injection overlay lets drills override fields of one GPU for a while or inject an
event; whatever the rules find on that GPU meanwhile is marked as a drill.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from gpuwatch.backends.base import Backend
from gpuwatch.config import Config, RulesConfig
from gpuwatch.errors import ConfigError, GpuReadError, StoreError
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
from gpuwatch.node.injection import Injection, checked_injection
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.node.store import QuarantineRecord, Store
from gpuwatch.validation import FAILED_RULE, ValidationResult

Validator = Callable[[GpuStatic, Sequence[int]], ValidationResult]
REPEAT_RULE = "repeat_offender"
VALIDATION_RETRY_S = 60.0  # a validation refused (processes on the GPU) is tried again this much later

log = logging.getLogger("gpuwatch.monitor")

Listener = Callable[[Snapshot, list[state.Decision]], None]
# An XID from NVML's event set and one from the kernel log, same GPU and code, this close in time: one fault.
DEDUPE_S = 5.0
KERNEL_XIDS_LISTED = 16  # per GPU, the newest kernel-log XIDs shown with their kernel time


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
        self._synced: dict[int, frozenset[str]] = {}  # the finding rules last written to the store, per GPU
        self._xids: dict[int, Counter[int]] = {i: Counter() for i in self.statics}
        self._xid_seen: dict[int, deque[list[Any]]] = {i: deque(maxlen=64) for i in self.statics}
        self._kernel_xids: dict[int, deque[GpuEvent]] = {i: deque(maxlen=KERNEL_XIDS_LISTED) for i in self.statics}
        self.kernel_log_readable: bool | None = None  # set by the kernel log follower (daemon.py)
        self.kernel_sxids_total = 0
        # The active test a burned-in GPU passes before release (daemon.py sets it on live backends).
        self.validator: Validator | None = None
        self._validating: dict[int, threading.Thread] = {}
        self._validate_after: dict[int, float] = {}
        # Findings held until an operator releases the GPU (repeat offender, failed validation), by rule.
        self._held: dict[int, dict[str, Finding]] = {i: {} for i in self.statics}
        self._findings: dict[int, list[Finding]] = {i: [] for i in self.statics}
        self._drill_until: dict[int, float] = {}
        self._injections: dict[int, Injection] = {}
        self._injection_ids = itertools.count(1)
        self._trainers: tuple[TrainerInfo, ...] = ()
        self._last_slow = float("-inf")
        self._samples_total = 0
        self._sample_errors_total = 0
        self._sample_duration_s = 0.0
        # Writes the store refused (full disk, read-only): in force, journaled (store.py), retried every tick, in order.
        self._unsaved_quarantines: MutableMapping[str, QuarantineRecord | None] = store.pending if store else {}
        self._unsaved_decisions: deque[tuple[Any, ...]] = deque(maxlen=10000)
        self._store_error = ""
        self._store_write_errors = 0
        self._node = self._restore(state.initial(sorted(self.statics)))
        self._node_findings = node.judge(len(self.statics), config.expected_gpus, self.clock(), self.rules)
        self._restore_held()
        self.snapshot = self._build_snapshot(self.clock())

    # ---------------------------------------------------------------------------------------
    # sampling and events

    def tick(self) -> Snapshot:
        """Sample every GPU once, judge, publish. One GPU failing never stops the others."""
        now = self.clock()
        slow = now - self._last_slow >= self.config.slow_interval_s
        if slow:
            self._last_slow = now
        readings: list[GpuSample | GpuError] = []
        started = time.perf_counter()
        for index, static in self.statics.items():
            try:
                readings.append(self.backend.sample(index, now, slow=slow))
            except GpuReadError as exc:
                readings.append(GpuError(now, index, static.uuid, exc.kind, exc.detail))
            except Exception as exc:  # a bug or odd failure on one GPU must not hide the others
                log.exception("GPU %d: sample failed", index)
                readings.append(GpuError(now, index, static.uuid, "unknown", f"{type(exc).__name__}: {exc}"))
        duration = time.perf_counter() - started
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
                self._record(self._overlay(reading, now))
            return self._judge_and_publish(now)

    def handle_events(self, readings: Iterable[GpuEvent | GpuError]) -> Snapshot | None:
        """Judge event-type faults at once, not at the next tick."""
        readings = list(readings)
        trainers = self._read_trainers(self.clock()) if readings else self._trainers
        with self._lock:
            readings = [r for r in readings if r.index in self.statics]
            batch = [r for r in readings if not self._duplicate(r)]
            if not batch:  # only duplicates: the listing (and an XID's pid, from the kernel log) may have grown
                return self._after_decisions([], self.snapshot.t) if readings else None
            self._trainers = trainers  # the ranks as they are now, not at the last tick: a stop needs them
            for reading in batch:
                self._record(reading)
            return self._judge_and_publish(max(max(r.t for r in batch), self.clock()))

    def _duplicate(self, reading: GpuEvent | GpuError) -> bool:
        """True for an XID already taken from the other source (NVML events, kernel log); lists kernel XIDs."""
        if not isinstance(reading, GpuEvent) or reading.kind != "xid":
            return False
        if reading.source == "kmsg":
            self._kernel_xids[reading.index].append(reading)
        seen = self._xid_seen[reading.index]
        for entry in seen:  # each event pairs with at most one of the other source
            other: GpuEvent = entry[0]
            close = abs(other.t - reading.t) <= DEDUPE_S
            if not entry[1] and other.source != reading.source and other.xid == reading.xid and close:
                entry[1] = True
                entry[0] = dataclasses.replace(
                    other, pid=other.pid or reading.pid, detail=other.detail or reading.detail
                )
                return True
        seen.append([reading, False])
        return False

    def run_events(self, stop: threading.Event, timeout_s: float = 0.5) -> None:
        """The event thread: wait in the backend's event call and hand each batch on."""
        while not stop.is_set():
            try:
                readings = self.backend.wait_events(timeout_s)
            except Exception:  # a broken event path must not kill the thread that would see the next XID
                log.exception("event wait failed; retrying in 1 s")
                stop.wait(1.0)
                continue
            if readings:
                log.info("events: %s", ", ".join(_describe(r) for r in readings))
                self.handle_events(readings)

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
            self._drop_held(index)
            node, decisions = state.release(self._node, index, self.clock(), reason)
            self._node = node
            return self._status(self._after_decisions(decisions), index)

    def release_validated(self, index: int, reason: str = "operator") -> tuple[GpuStatus, ValidationResult]:
        """Run the active test first (blocking); release only if it passes, else hold a finding naming the figures."""
        self._require(index)
        if self.validator is None:
            return self._status(self.snapshot, index), ValidationResult("refused", "no GPU test on this backend")
        with self._lock:
            if index in self._validating:
                return self._status(self.snapshot, index), ValidationResult("refused", "a validation is running")
            self._validating[index] = threading.current_thread()
        result = self._validate(index)
        with self._lock:
            self._validating.pop(index, None)
            if result.passed:
                log.warning("GPU %d: validation passed: %s", index, result.reason)
                return self.release(index, f"{reason}; validation passed: {result.reason}"), result
            return self._status(self._validation_failed(index, result), index), result

    def inject(
        self, index: int, fields: Mapping[str, Any], duration_s: float, event: str | None = None, xid: int | None = None
    ) -> Injection:
        """Override `fields` of GPU `index` for `duration_s` and/or inject an event; marks findings as drills."""
        self._require(index)
        fields = checked_injection(fields)
        if not (math.isfinite(duration_s) and 0 < duration_s <= 86400):
            raise ConfigError(f"inject: duration_s: {duration_s!r} is not within (0, 86400] seconds")
        now = self.clock()
        static = self.statics[index]
        injected_event = GpuEvent(now, index, static.uuid, event, xid, drill=True) if event else None
        injection = Injection(next(self._injection_ids), index, dict(fields), now, now + duration_s, injected_event)
        with self._lock:
            if fields:
                self._injections[index] = injection
            self._drill_until[index] = max(self._drill_until.get(index, 0.0), injection.until + self._keep_s)
        log.warning("drill: injection %s on GPU %d for %.0f s", injection.as_dict(), index, duration_s)
        if injected_event:
            self.handle_events([injected_event])
        return injection

    def injections(self) -> list[Injection]:
        now = self.clock()
        with self._lock:
            return [i for i in self._injections.values() if i.until > now]

    def end_injection(self, injection_id: int) -> Injection | None:
        """End an injection in force now (a mistyped `for=86400` must not hold a GPU faulty for a day); None if
        there is none by that id. What it caused stays marked as a drill as after any end: while the windows hold it."""
        now = self.clock()
        with self._lock:
            injection = next((i for i in self._injections.values() if i.id == injection_id and i.until > now), None)
            if injection is None:
                return None
            del self._injections[injection.index]
            self._drill_until[injection.index] = min(self._drill_until.get(injection.index, 0.0), now + self._keep_s)
        log.warning("drill: injection %d on GPU %d ended early", injection.id, injection.index)
        return dataclasses.replace(injection, until=now)

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
        """The running ranks' reports, not older than trainer.stale_after_s (every report is untrusted)."""
        if self.runtime is None:
            return ()
        reports = self.runtime.read_reports()
        stale_after_s = self.config.trainer.stale_after_s
        return tuple(r.info for r in reports if r.running and now - (r.info.updated_t or 0.0) <= stale_after_s)

    def _overlay(self, reading: GpuSample | GpuError, now: float) -> GpuSample | GpuError:
        injection = self._injections.get(reading.index)
        if injection is None:
            return reading
        if injection.until <= now:
            del self._injections[reading.index]
            log.warning("drill: injection %d on GPU %d ended", injection.id, reading.index)
            return reading
        if isinstance(reading, GpuError):
            return reading
        if injection.fields.get("error"):
            return GpuError(reading.t, reading.index, reading.uuid, str(injection.fields["error"]), "injected")
        return dataclasses.replace(reading, **{k: v for k, v in injection.fields.items() if k != "error"})

    def _record(self, reading: GpuSample | GpuEvent | GpuError) -> None:
        if isinstance(reading, GpuEvent) and reading.kind == "xid" and reading.xid is not None:
            # An XID the kernel log kept from before the window (boot, daemon down) is listed, not counted:
            # the counter feeds alerts, and an old fault must raise none.
            if reading.t >= self.clock() - self.rules.xid_window_s:
                self._xids[reading.index][reading.xid] += 1
        try:
            self._running[reading.index].add(reading)
        except Exception:  # a value the rules choke on stays on its GPU: the reading is dropped, the others go on
            log.exception("GPU %d: rules failed on a reading; dropped", reading.index)

    def _judge_and_publish(self, now: float) -> Snapshot:
        findings: dict[int, list[Finding]] = {}
        for index, running in self._running.items():
            if not running.seen:
                continue  # never read yet: the state machine keeps it unknown
            drill = self._drill_until.get(index, 0.0) > now
            try:
                found = engine.judge(running.at(now), self.rules)
            except Exception:  # a bug or odd value on one GPU must not stop judging the others
                log.exception("GPU %d: rules failed; keeping its last findings", index)
                found = list(self._findings.get(index, ()))
            findings[index] = [dataclasses.replace(f, drill=True) if drill else f for f in found]
            findings[index] += self._held[index].values()
        self._findings = findings
        gated = self.statics.keys() if self.validator is not None and self.config.validation.before_release else ()
        node, decisions = state.step(
            self._node, findings, now, self.config.policy, self.quarantine_gate, validate=gated
        )
        self._node = node
        for decision in [d for d in decisions if d.kind == "validate"]:
            self._start_validation(decision.index, now)
        decisions = [d for d in decisions if d.kind != "validate"]
        decisions += self._escalate_repeat_offenders(decisions)
        return self._after_decisions(decisions, now)

    # ---------------------------------------------------------------------------------------
    # validation before release, repeat offenders, findings held for the operator

    def _start_validation(self, index: int, now: float) -> None:
        """Validate a burned-in GPU in a thread (minutes of GPU test must not hold the lock); once at a time."""
        if index in self._validating or self._validate_after.get(index, 0.0) > now:
            return
        log.info("GPU %d burned in: running the GPU test before release", index)
        thread = threading.Thread(
            target=self._auto_validation, args=(index,), name=f"gpuwatch-validate-{index}", daemon=True
        )
        self._validating[index] = thread
        thread.start()

    def _auto_validation(self, index: int) -> None:
        result = self._validate(index)
        with self._lock:
            self._validating.pop(index, None)
            now = self.clock()
            gpu = next(g for g in self._node.gpus if g.index == index)
            still_due = gpu.quarantined and gpu.quarantine_auto and gpu.state is Health.HEALTHY
            if result.passed and not still_due:  # a new finding or an operator meanwhile: burn-in starts over
                log.warning("GPU %d: validation passed, but the GPU changed meanwhile: not released", index)
            elif result.passed:
                log.warning("GPU %d: validation passed: %s", index, result.reason)
                node, decisions = state.release(
                    self._node, index, now, f"validation passed: {result.reason}", auto=True
                )
                self._node = node
                self._after_decisions(decisions, now)
            elif result.outcome == "refused":
                log.warning("GPU %d: validation %s; trying again in %g s", index, result.reason, VALIDATION_RETRY_S)
                self._validate_after[index] = now + VALIDATION_RETRY_S
            else:
                self._validation_failed(index, result)

    def _validate(self, index: int) -> ValidationResult:
        """The validator on GPU `index`, given the processes NVML last listed on it (it refuses any)."""
        assert self.validator is not None
        last = self._running[index].last
        try:
            return self.validator(self.statics[index], last.pids if last is not None else ())
        except Exception as exc:  # a bug in the gate must keep the GPU out, not crash a thread silently
            log.exception("GPU %d: validation failed to run", index)
            return ValidationResult("failed", f"validation could not run: {type(exc).__name__}: {exc}")

    def _validation_failed(self, index: int, result: ValidationResult) -> Snapshot:
        """Hold a finding with the figures: the GPU stays quarantined (no burn-in) until an operator releases it."""
        now = self.clock()
        reason = f"the GPU test failed before release: {result.reason}"
        log.error("GPU %d: %s", index, reason)
        self._hold(index, Finding(FAILED_RULE, Severity.DEGRADED, reason, Action.HARDWARE_INSPECTION, now))
        return self._judge_and_publish(now) if self._running[index].seen else self._after_decisions([], now)

    def _escalate_repeat_offenders(self, decisions: list[state.Decision]) -> list[state.Decision]:
        """An automatic quarantine that is the uuid's `repeat_quarantines`-th within the window: held for inspection."""
        policy, extra = self.config.policy, []
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
            self._hold(
                decision.index, Finding(REPEAT_RULE, Severity.DEGRADED, reason, Action.HARDWARE_INSPECTION, decision.t)
            )
            self._findings.setdefault(decision.index, []).append(self._held[decision.index][REPEAT_RULE])
            node, held = state.quarantine(self._node, decision.index, f"repeat offender: {reason}", decision.t)
            self._node = node
            extra += [dataclasses.replace(d, kind="escalate") for d in held]
        return extra

    def _hold(self, index: int, finding: Finding) -> None:
        static = self.statics[index]
        finding = dataclasses.replace(finding, index=index, uuid=static.uuid)
        self._held[index][finding.rule] = finding
        if self.store is not None:
            try:
                self.store.hold_finding(static.uuid, finding)
            except StoreError as exc:
                log.error("cannot store the held finding %s of GPU %d: %s", finding.rule, index, exc)

    def _drop_held(self, index: int) -> None:
        if not self._held[index]:
            return
        self._held[index] = {}
        self._findings[index] = [f for f in self._findings.get(index, []) if f.rule not in (REPEAT_RULE, FAILED_RULE)]
        if self.store is not None:
            try:
                self.store.drop_held_findings(self.statics[index].uuid)
            except StoreError as exc:
                log.error("cannot drop the held findings of GPU %d: %s", index, exc)

    def _restore_held(self) -> None:
        if self.store is None:
            return
        held = self.store.held_findings()
        for index, static in self.statics.items():
            for finding in held.get(static.uuid, ()):
                log.warning("GPU %d (%s) still holds %s: %s", index, static.uuid, finding.rule, finding.reason)
                self._held[index][finding.rule] = dataclasses.replace(finding, index=index)

    def _after_decisions(self, decisions: list[state.Decision], now: float | None = None) -> Snapshot:
        now = self.clock() if now is None else now
        for decision in decisions:
            self._log(decision)
            self._queue(decision)
        self._write_store(now)
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

    def _sync_findings(self, store: Store, index: int, uuid: str, now: float) -> None:
        """Write a GPU's findings to the store when its set of rules changed (only this monitor writes them)."""
        found = self._findings.get(index, ())
        rules = frozenset(f.rule for f in found)
        if self._synced.get(index) != rules:
            store.sync_findings(uuid, index, list(found), now)
            self._synced[index] = rules

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

    def _queue(self, decision: state.Decision) -> None:
        """Line a decision up for the store; `_write_store` writes everything queued, oldest first."""
        if self.store is None:
            return
        static = self.statics[decision.index]
        gpu_state = self._node.gpus[self._position(decision.index)]
        if decision.kind in {"quarantine", "escalate"}:
            self._unsaved_quarantines[static.uuid] = QuarantineRecord(
                static.uuid,
                decision.index,
                gpu_state.quarantine_reason,
                gpu_state.quarantined_since or decision.t,
                decision.auto,
                decision.drill,
                gpu_state.epoch,
            )
        elif decision.kind == "release":
            self._unsaved_quarantines[static.uuid] = None
        row = (decision.t, decision.index, static.uuid, decision.kind, decision.state.value, decision.reason)
        self._unsaved_decisions.append((*row, decision.drill))

    def _write_store(self, now: float) -> None:
        """Write queued quarantine changes, decisions and findings; on failure keep them and say so once.

        A full or read-only disk must never make a decision disappear: it stays in force in memory
        (status.json, signals and the API show it), /healthz and gpuwatch_store_degraded say the
        store is behind, and every later tick retries until the writes land.
        """
        if self.store is None:
            return
        try:
            while self._unsaved_quarantines:
                uuid, record = next(iter(self._unsaved_quarantines.items()))
                if record is None:
                    self.store.clear_quarantine(uuid)
                else:
                    self.store.set_quarantine(record)
                del self._unsaved_quarantines[uuid]
            while self._unsaved_decisions:
                self.store.add_decision(*self._unsaved_decisions[0])
                self._unsaved_decisions.popleft()
            for index, static in self.statics.items():
                self._sync_findings(self.store, index, static.uuid, now)
        except StoreError as exc:  # a full disk must not stop judging: the Snapshot and status.json still go out
            self._store_write_errors += 1
            if not self._store_error:
                log.error(
                    "state store cannot write; %d quarantine change(s) in force and journaled, retried every tick: %s",
                    len(self._unsaved_quarantines),
                    exc,
                )
            self._store_error = str(exc) or type(exc).__name__
            return
        if self._store_error:
            log.warning("state store writes again: every quarantine change is saved")
            self._store_error = ""

    def unsaved(self, index: int) -> bool:
        """True while a quarantine or release of GPU `index` is in force but not yet durable."""
        static = self.statics.get(index)
        with self._lock:
            return static is not None and static.uuid in self._unsaved_quarantines

    def flush_store(self) -> int:
        """Retry the queued writes now (at shutdown); the number of quarantine changes still unsaved."""
        with self._lock:
            self._write_store(self.clock())
            return len(self._unsaved_quarantines)

    def _position(self, index: int) -> int:
        for position, gpu_state in enumerate(self._node.gpus):
            if gpu_state.index == index:
                return position
        raise KeyError(index)

    def _restore(self, node: state.NodeState) -> state.NodeState:
        """Seed the state machine with quarantines and epochs persisted before a restart."""
        if self.store is None:
            return node
        records = self.store.quarantines()
        epochs = self.store.epochs()
        restored = []
        for gpu_state in node.gpus:
            uuid = self.statics[gpu_state.index].uuid
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

    def _build_snapshot(self, now: float) -> Snapshot:
        trainers_by_uuid: dict[str, list[TrainerInfo]] = {}
        for trainer in self._trainers:
            trainers_by_uuid.setdefault(trainer.gpu_uuid or "", []).append(trainer)
        gpus = []
        for gpu_state in self._node.gpus:
            index = gpu_state.index
            static = self.statics[index]
            last_sample, last_error = self._running[index].last, self._running[index].last_error
            if last_error and last_sample and last_error.t < last_sample.t:
                last_error = None
            gpus.append(  # by position, in GpuStatus's and Snapshot's field order: a third cheaper than by keyword
                GpuStatus(
                    static,
                    gpu_state.state,
                    tuple(self._findings.get(index, ())),
                    gpu_state.quarantined,
                    gpu_state.quarantine_reason,
                    gpu_state.quarantined_since,
                    gpu_state.epoch,
                    last_sample,
                    last_error,
                    tuple(sorted(self._xids[index].items())),
                    self._drill_until.get(index, 0.0) > now,
                    tuple(trainers_by_uuid.get(static.uuid, ())),
                    tuple(self._kernel_xids[index]),
                    tuple([entry[0] for entry in self._xid_seen[index]]),
                )
            )
        return Snapshot(
            now,
            self.backend.name,
            tuple(gpus),
            self._sample_duration_s,
            self._sample_errors_total,
            self._samples_total,
            self._node.breaker_tripped,
            self._node.breaker_refusals,
            self._trainers,
            self._store_error,
            len(self._unsaved_quarantines),
            self._store_write_errors,
            self.kernel_log_readable,
            self.kernel_sxids_total,
            self._node_findings,
        )


def _describe(reading: GpuEvent | GpuError) -> str:
    if isinstance(reading, GpuEvent):
        return f"GPU {reading.index} {reading.kind}" + (f" {reading.xid}" if reading.xid is not None else "")
    return f"GPU {reading.index} error {reading.kind}"
