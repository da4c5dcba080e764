"""Judging without a daemon: `gpuwatch check` (a one-shot sample) and `gpuwatch replay` (a trace).

Both drive the same Monitor the daemon uses, with no store and no runtime dir, so a trace
replayed here is judged exactly as the live daemon would judge it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.backends import open_backend
from gpuwatch.backends.base import Scripted
from gpuwatch.backends.replay import ReplayBackend, iter_ticks
from gpuwatch.backends.trace import Trace
from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config
from gpuwatch.model import GpuError, GpuEvent, GpuSample, Health, Snapshot, worst
from gpuwatch.node.monitor import Monitor


def check(config: Config, samples: int = 3, spacing_s: float = 1.0, duration_s: float | None = None) -> Snapshot:
    """Sample every GPU `samples` times `spacing_s` apart (or for `duration_s`) and judge.

    The caller maps states to an exit code. On the sim backend time is simulated and passes at once,
    and `duration_s` defaults to the scenario's `judged_by_s`, so `check --sim-scenario RULE` shows
    its fault without waiting for it; the scenario's shortened rule windows apply, as in the daemon.
    """
    backend, statics = open_backend(config)
    rules = config.rules
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    if isinstance(backend, Scripted):
        scenario = backend.scenario
        simulated = ManualClock(time.time())
        clock, sleep = simulated, simulated.advance
        backend.clock = simulated  # the sim's scripted events follow it
        rules = dataclasses.replace(rules, **scenario.rules_overrides)
        if duration_s is None and scenario.judged_by_s:
            duration_s = scenario.judged_by_s
    if duration_s is not None:
        samples = max(samples, int(duration_s / spacing_s) + 1)
    monitor_log = logging.getLogger("gpuwatch.monitor")
    monitor_log.addFilter(_no_decision_lines)
    try:
        monitor = Monitor(backend, statics, config, rules=rules, clock=clock)
        snapshot = monitor.tick()
        for _ in range(samples - 1):
            sleep(spacing_s)
            monitor.handle_events(backend.wait_events(0.0))
            snapshot = monitor.tick()
        return snapshot
    finally:
        monitor_log.removeFilter(_no_decision_lines)
        backend.close()


def _no_decision_lines(record: logging.LogRecord) -> bool:
    """Drop the monitor's decision lines (`GPU 5 (…): quarantine: …`): a check keeps no quarantine and acts on
    nothing; its own output says each GPU's state."""
    return record.funcName != "_log"


@dataclass
class GpuReplay:
    """What one GPU went through in a replayed trace."""

    index: int
    uuid: str
    worst_state: Health = Health.HEALTHY
    final_state: Health = Health.UNKNOWN
    quarantined: bool = False
    findings: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "worst_state": self.worst_state.value,
            "final_state": self.final_state.value,
            "quarantined": self.quarantined,
            "findings": self.findings,
        }


def replay(trace: Trace, config: Config) -> list[GpuReplay]:
    """Run a trace through the rules and the state machine; record worst state and each new finding."""
    clock = ManualClock(next((r.t for r in trace.readings), 0.0))
    config = dataclasses.replace(config, backend="replay", interval_s=max(1.0, _median_spacing(trace)))
    # The backend only names the source here: readings come from iter_ticks, judged on the trace's time.
    monitor = Monitor(ReplayBackend(config), trace.statics, config, clock=clock)
    results = {s.index: GpuReplay(s.index, s.uuid) for s in trace.statics}
    open_rules: dict[int, set[str]] = {s.index: set() for s in trace.statics}
    for tick in iter_ticks(trace):
        clock.t = tick.t
        events = [r for r in tick.readings if isinstance(r, GpuEvent)]
        readings = [r for r in tick.readings if isinstance(r, (GpuSample, GpuError))]
        snapshot = monitor.handle_events(events) if events else None
        if readings:
            snapshot = monitor.judge_readings(readings)
        if snapshot is None:
            continue
        for status in snapshot.gpus:
            result = results[status.index]
            result.worst_state = worst([result.worst_state, status.state])
            result.final_state = status.state
            result.quarantined = status.quarantined
            for f in status.findings:
                if f.rule not in open_rules[status.index]:
                    result.findings.append(
                        {"t": f.t, "rule": f.rule, "severity": f.severity.value, "action": f.action.value}
                    )
            open_rules[status.index] = {f.rule for f in status.findings}
    return [results[i] for i in sorted(results)]


def _median_spacing(trace: Trace) -> float:
    times = sorted({r.t for r in trace.readings if isinstance(r, GpuSample)})
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return gaps[len(gaps) // 2] if gaps else 1.0
