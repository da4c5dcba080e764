"""running.py against the windowed reference: the same findings at the same times, reading by reading.

Every judgement is made both ways from the same stream of readings: `engine.evaluate` over a History
kept as the monitor kept it before (every reading within `keep_s` of the newest of its kind, at least
one, the first sample as baseline), and `engine.judge` over the RunningState. The streams are every
sim scenario (events judged as they fall due, like the daemon) and the real H200 trace, each with the
default windows and with short ones, so that readings age out of every window and the keep horizon.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import pytest

from gpuwatch.backends.sim import SCENARIOS, SimBackend
from gpuwatch.config import Config, RulesConfig, SimConfig
from gpuwatch.errors import GpuReadError
from gpuwatch.health import engine
from gpuwatch.health.history import History
from gpuwatch.health.running import RunningState
from gpuwatch.model import REASON_SW_POWER_CAP, Finding, GpuError, GpuEvent, GpuSample, GpuStatic

from .helpers import H200, T0, sample

Reading = GpuSample | GpuEvent | GpuError
# Windows short enough that readings leave every window, and the keep horizon, within a run.
SHORT = {"clock_window_s": 20.0, "thermal_window_s": 25.0, "power_window_s": 40.0}
SHORT_ALL = {**SHORT, "ecc_window_s": 90.0, "xid_window_s": 60.0}


class Both:
    """One GPU judged both ways; `compare` asserts they agree and returns the findings."""

    def __init__(self, static: GpuStatic, cfg: RulesConfig, interval_s: float) -> None:
        self.static, self.cfg = static, cfg
        self.keep_s = engine.max_window_s(cfg) + 2 * interval_s
        self.kept: dict[type, deque[Any]] = {GpuSample: deque(), GpuEvent: deque(), GpuError: deque()}
        self.baseline: GpuSample | None = None
        self.running = RunningState(static, engine.conditions(static, cfg), self.keep_s)

    def add(self, reading: Reading) -> None:
        if isinstance(reading, GpuSample) and self.baseline is None:
            self.baseline = reading
        kept = self.kept[type(reading)]
        kept.append(reading)
        while len(kept) > 1 and kept[0].t < reading.t - self.keep_s:
            kept.popleft()
        self.running.add(reading)

    def compare(self, now: float) -> list[Finding]:
        history = History(
            static=self.static,
            now=now,
            samples=tuple(self.kept[GpuSample]),
            events=tuple(self.kept[GpuEvent]),
            errors=tuple(self.kept[GpuError]),
            baseline=self.baseline,
        )
        reference = engine.evaluate(history, self.cfg)
        incremental = engine.judge(self.running.at(now), self.cfg)
        assert incremental == reference, f"at t={now}"
        return incremental


def run_scenario(name: str, cfg: RulesConfig, interval_s: float, seconds: float) -> list[Finding]:
    """The sim scenario on 3 GPUs, ticked every `interval_s`, events judged first as the daemon does."""
    t = [T0 + 0.3217]  # a clock that is not on whole seconds, as a real one is not
    backend = SimBackend(Config(backend="sim", sim=SimConfig(gpus=3, scenario=name, seed=0)), clock=lambda: t[0])
    statics = backend.open()
    gpus = {s.index: Both(s, cfg, interval_s) for s in statics}
    found: list[Finding] = []
    while t[0] < T0 + seconds:
        t[0] += interval_s
        events = backend.wait_events(0.0)
        if events:
            for event in events:
                gpus[event.index].add(event)
            found += judge_all(gpus, max(max(e.t for e in events), t[0]))
        for s in statics:
            try:
                gpus[s.index].add(backend.sample(s.index, t[0]))
            except GpuReadError as exc:
                gpus[s.index].add(GpuError(t[0], s.index, s.uuid, exc.kind, exc.detail))
        found += judge_all(gpus, t[0])
    backend.close()
    return found


def judge_all(gpus: dict[int, Both], now: float) -> list[Finding]:
    return [f for both in gpus.values() if both.running.seen for f in both.compare(now)]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("windows", ["scenario", "short"])
def test_every_scenario_gives_the_same_findings_both_ways(name: str, windows: str) -> None:
    overrides = SCENARIOS[name].rules_overrides if windows == "scenario" else SHORT_ALL
    cfg = dataclasses.replace(RulesConfig(), **overrides)
    found = run_scenario(name, cfg, interval_s=5.0, seconds=700.0)
    if name not in {"healthy"}:
        assert found, "the scenario's fault was never found: the comparison proved nothing"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_agrees_at_a_1s_interval(name: str) -> None:
    """Fractional spacing and many samples per window: the held sums are where float order could tell."""
    cfg = dataclasses.replace(RulesConfig(), **{**SCENARIOS[name].rules_overrides, **SHORT_ALL})
    run_scenario(name, cfg, interval_s=1.0, seconds=240.0)


def test_a_long_healthy_run_past_the_keep_horizon_agrees() -> None:
    """Two hours at 30 s with the default windows: the hour-long ECC window fills and slides."""
    run_scenario("ecc_correctable_rate", RulesConfig(), interval_s=30.0, seconds=7200.0)


@pytest.mark.parametrize(
    ("overrides", "unexplained", "expected"),
    [
        ({}, False, set()),
        (SHORT_ALL, False, set()),
        # Sensitive enough that the healthy trace trips the thermal rule.
        ({**SHORT, "level_duty": 0.2, "thermal_margin_c": 40}, False, {"thermal_margin_low"}),
        # The trace with its SW power cap bit (0x4) cleared: its capped clocks are then unexplained, and
        # each step from a busy 1980 MHz to a capped 1455 MHz is a power fall.
        (
            {**SHORT, "level_duty": 0.2, "power_unstable_drop_ratio": 0.99, "clock_low_ratio": 0.76},
            True,
            {"sm_clock_low_unexplained", "power_unstable"},
        ),
    ],
    ids=["default", "short", "thermal", "unexplained"],
)
def test_the_real_h200_trace_gives_the_same_findings_both_ways(
    healthy_trace: tuple[GpuStatic, list[GpuSample]], overrides: dict[str, float], unexplained: bool, expected: set[str]
) -> None:
    static, samples = healthy_trace
    cfg = dataclasses.replace(RulesConfig(), **overrides)
    both = Both(static, cfg, interval_s=1.0)
    found = []
    for s in samples:
        if unexplained and s.clocks_event_reasons is not None:
            s = dataclasses.replace(s, clocks_event_reasons=s.clocks_event_reasons & ~REASON_SW_POWER_CAP)
        both.add(s)
        found += both.compare(s.t)
    assert {f.rule for f in found} == expected


def test_counters_events_and_errors_age_out_alike() -> None:
    """A hand-made stream through every kind of reading: counter rises and resets, gaps, errors, events."""
    cfg = dataclasses.replace(RulesConfig(), **SHORT_ALL)
    both = Both(H200, cfg, interval_s=5.0)
    readings: list[Reading] = []
    for i in range(120):
        t = i * 5.0
        if 40 <= i < 60:  # the GPU falls off the bus, then comes back
            readings.append(GpuError(T0 + t, 0, H200.uuid, "gpu_lost" if i % 3 else "unknown", f"read {i}"))
            continue
        readings.append(
            sample(
                t,
                ecc_sbe_volatile=0 if i == 70 else i * 7,  # a reset clears the volatile counter
                ecc_dbe_aggregate=i // 25,
                clocks_event_reasons=0x8 if i % 4 else 0x4,
                sm_clock_mhz=600 if i % 4 else 1455,
            )
        )
        if i % 17 == 0:
            readings.append(GpuEvent(T0 + t + 1, 0, H200.uuid, "xid", 31 if i % 2 else 79, drill=i % 3 == 0))
    found = []
    for reading in readings:
        both.add(reading)
        found += both.compare(reading.t)
    assert {"gpu_lost", "gpu_read_error", "ecc_uncorrectable", "clocks_hw_slowdown", "xid_critical"} <= {
        f.rule for f in found
    }


def test_the_state_stays_bounded_in_bytes() -> None:
    """An hour at 1 s keeps no more than its short windows need: kilobytes, not the hour's samples."""
    cfg = RulesConfig()
    both = RunningState(H200, engine.conditions(H200, cfg), engine.max_window_s(cfg) + 2.0)
    sizes = []
    for hour in range(2):
        for i in range(3600):
            both.add(sample(hour * 3600 + i, ecc_sbe_volatile=i // 100))
        sizes.append(both.nbytes())
    assert sizes[1] < 64 * 1024 and abs(sizes[1] - sizes[0]) < 0.1 * sizes[0], sizes  # an hour more, no growth
