"""A tick costs the same with an hour of history as with none: counted in Python calls, not timed.

The rules judge a running state (health/running.py), so what a tick does must not grow with how long
the daemon has run. Counting the calls a tick makes (sys.setprofile) is exact on a loaded machine,
where timing a 100 µs tick is not. An hour of application XIDs (one every few seconds on a GPU,
the `xid_app_repeated` scenario) once made every tick walk every event kept for the longest window
(an hour), though the XID rule looks at ten minutes and the ECC rules at other kinds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from gpuwatch.backends.sim import SimBackend
from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config, RulesConfig, SimConfig
from gpuwatch.node.monitor import Monitor

T0 = 1_800_000_000.0
TICKS = 20
MARGIN = 1.1


def calls_per_tick(tmp_path: Path, scenario: str, history_s: float) -> float:
    """Python and C calls per Monitor.tick on 2 sim GPUs after `history_s` of readings and events at 1 s."""
    clock = ManualClock(T0)
    root = tmp_path / f"{scenario}-{history_s:g}"
    config = Config(
        backend="sim",
        interval_s=1.0,
        sim=SimConfig(gpus=2, scenario=scenario),
        state_dir=str(root / "state"),
        runtime_dir=str(root / "run"),
    )
    backend = SimBackend(config, clock=clock)
    statics = list(backend.open())
    monitor = Monitor(backend, statics, config, clock=clock)
    for _ in range(int(history_s)):  # readings and events folded in as the daemon would, without judging each
        clock.t += 1.0
        monitor.preload(backend.wait_events(0.0))
        monitor.preload(backend.sample(s.index, clock.t) for s in statics)
    calls = 0

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    for _ in range(TICKS):
        clock.t += 1.0
        monitor.preload(backend.wait_events(0.0))
        sys.setprofile(count)
        try:
            monitor.tick()
        finally:
            sys.setprofile(None)
    backend.close()
    return calls / TICKS


def test_a_healthy_gpus_tick_is_as_cheap_after_an_hour_as_at_start(tmp_path: Path) -> None:
    none, hour = calls_per_tick(tmp_path, "healthy", 0), calls_per_tick(tmp_path, "healthy", 3600)
    assert hour <= MARGIN * none, f"{none:.0f} calls a tick with no history, {hour:.0f} after an hour"


@pytest.mark.parametrize("scenario", ["xid_app_repeated"])
def test_events_older_than_their_rules_window_cost_a_tick_nothing(tmp_path: Path, scenario: str) -> None:
    """Past one XID window of history (10 min) the tick stays flat, though an hour of events is kept."""
    window = calls_per_tick(tmp_path, scenario, RulesConfig.xid_window_s)
    hour = calls_per_tick(tmp_path, scenario, 3600)
    assert hour <= MARGIN * window, f"{window:.0f} calls a tick after 10 min of XIDs, {hour:.0f} after an hour"
