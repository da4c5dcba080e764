"""The sim backend: deterministic, realistic when healthy, and each scenario's fault on the right GPU at the right time.

These tests look at raw samples and events, never at the health rules.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatch.backends.base import Backend
from gpuwatch.backends.sim import BUSY_S, CYCLE_S, SCENARIOS, SimBackend
from gpuwatch.backends.trace import read_trace
from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config, RulesConfig, SimConfig
from gpuwatch.errors import BackendError, ConfigError, GpuReadError
from gpuwatch.health import node
from gpuwatch.health.engine import ALL_RULE_IDS
from gpuwatch.model import GpuEvent, GpuSample

T0 = 1_800_000_000.0
FAULTY = 1
START_S = 10.0
ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = next(
    (
        p / "traces" / "h200-healthy-workload.jsonl"
        for p in (ROOT / "shared", ROOT.parent / "shared")
        if (p / "traces" / "h200-healthy-workload.jsonl").exists()
    ),
    None,
)


def make(scenario: str = "healthy", gpus: int = 8, seed: int = 0, clock: Callable[[], float] = time.time) -> SimBackend:
    backend = SimBackend(Config(sim=SimConfig(gpus=gpus, seed=seed, scenario=scenario)), clock=clock)
    backend.open()
    return backend


def run(backend: SimBackend, seconds: float, interval: float = 1.0, gpus: int = 8) -> dict[int, list[GpuSample]]:
    """Sample every GPU every `interval` seconds from T0; a failed read is left out."""
    out: dict[int, list[GpuSample]] = {i: [] for i in range(gpus)}
    for k in range(int(seconds / interval) + 1):
        for i in range(gpus):
            try:
                out[i].append(backend.sample(i, T0 + k * interval, slow=k % 5 == 0))
            except GpuReadError:
                pass
    return out


def test_is_a_backend() -> None:
    backend = make()
    assert isinstance(backend, Backend)
    assert backend.name == "sim"


def test_same_seed_same_samples_other_seed_other_samples() -> None:
    a, b, c = run(make(seed=7), 120, 5), run(make(seed=7), 120, 5), run(make(seed=8), 120, 5)
    assert a == b
    assert a != c
    assert make(seed=7).open() == make(seed=7).open()
    assert make(seed=7).open()[0].uuid != make(seed=8).open()[0].uuid


def test_statics_are_h200_like_and_distinct() -> None:
    statics = make(gpus=8).open()
    assert [s.index for s in statics] == list(range(8))
    assert len({s.uuid for s in statics}) == 8 and all(s.uuid.startswith("GPU-") for s in statics)
    assert len({s.pci_bus_id for s in statics}) == 8
    for s in statics:
        assert (s.name, s.max_sm_clock_mhz, s.max_mem_clock_mhz, s.power_limit_w) == ("NVIDIA H200", 1980, 3201, 700.0)
        assert (s.memory_total_bytes, s.slowdown_temp_c, s.shutdown_temp_c) == (150754820096, 89, 95)
        assert (s.mem_max_temp_c, s.gpu_max_temp_c) == (95, 87)
    if SHARED_TRACE is not None:
        recorded = read_trace(SHARED_TRACE).statics[0]
        # the recorded trace predates the PCIe link maxima (gen 5 x16 on that H200)
        same = dataclasses.replace(statics[0], uuid=recorded.uuid, pci_bus_id=recorded.pci_bus_id)
        assert dataclasses.replace(same, pcie_link_gen_max=None, pcie_link_width_max=None) == recorded


def test_healthy_values_stay_in_the_recorded_ranges() -> None:
    """An hour at 5 s: every value is one a healthy H200 shows (shared trace, DESIGN.md's DDP facts)."""
    samples = [s for per_gpu in run(make(), 3600, 5).values() for s in per_gpu]
    static = make().open()[0]
    busy = [s for s in samples if s.util_gpu_pct]
    idle = [s for s in samples if not s.util_gpu_pct]
    assert len(idle) > 8 * 5 * 3  # three 60 s checkpoint pauses in the hour
    for s in samples:
        assert s.clocks_event_reasons in (0, 1, 4)
        assert s.mem_clock_mhz == 3201 and s.pstate == 0
        assert 80.0 <= (s.power_w or 0) <= 700.0
        # An 8-GPU box runs hotter than the single card recorded (58 C), but far from any thermal limit.
        assert 30 <= (s.temp_c or 0) <= 70
        assert 30 <= (s.mem_temp_c or 0) <= 70
        assert 0 < (s.memory_used_bytes or 0) < (static.memory_total_bytes or 0)
        counters = (s.ecc_sbe_volatile, s.ecc_dbe_volatile, s.ecc_sbe_aggregate, s.ecc_dbe_aggregate)
        assert counters == (0, 0, 0, 0)
        assert (s.remapped_cor, s.remapped_unc, s.remapped_pending, s.remapped_failure) == (0, 0, 0, 0)
        assert len(s.pids) == 1
    for s in busy:
        assert (s.util_gpu_pct or 0) >= 97
        if s.clocks_event_reasons == 4:
            assert 1425 <= (s.sm_clock_mhz or 0) <= 1515
        else:
            assert s.sm_clock_mhz == 1980
        assert 290.0 <= (s.power_w or 0) <= 682.0
    powers = [s.power_w or 0 for s in busy]
    assert min(powers) < 400 and max(powers) > 650  # DDP compute/all-reduce swings at 100% utilization
    assert {s.sm_clock_mhz for s in idle} <= {345, 1980}
    assert all(81.0 <= (s.power_w or 0) <= 130.0 for s in idle)
    temps = [s.temp_c or 0 for s in busy if (s.t - T0) % CYCLE_S > 120]
    assert min(temps) >= 45
    if SHARED_TRACE is not None:
        recorded = [r for r in read_trace(SHARED_TRACE).readings if isinstance(r, GpuSample)]
        capped = {r.sm_clock_mhz for r in recorded if r.clocks_event_reasons == 4}
        assert {s.sm_clock_mhz for s in busy if s.clocks_event_reasons == 4} <= capped
        deep_idle = [r.power_w or 0 for r in recorded if r.clocks_event_reasons == 1]
        assert min(deep_idle) - 1 <= min(s.power_w or 0 for s in idle)


def test_slow_fields_accumulate() -> None:
    backend = make()
    fast = backend.sample(0, T0)
    assert (fast.energy_mj, fast.violation_power_ns, fast.violation_thermal_ns, fast.pcie_replay) == (None,) * 4
    first = backend.sample(0, T0 + 1, slow=True)
    backend.sample(0, T0 + 6)
    second = backend.sample(0, T0 + 11, slow=True)
    assert first.energy_mj is not None and second.energy_mj is not None
    assert 10 * 280 * 1000 < second.energy_mj - first.energy_mj < 10 * 700 * 1000
    assert first.violation_power_ns is not None and second.violation_power_ns is not None
    assert second.violation_power_ns - first.violation_power_ns <= 10 * 10**9
    assert second.violation_power_ns > first.violation_power_ns  # capped most of the time
    assert second.violation_thermal_ns == 0 and second.pcie_replay == 0
    between = backend.sample(0, T0 + 16)  # not slow: the last slow reading, repeated
    assert (between.energy_mj, between.violation_power_ns, between.pcie_replay) == (
        second.energy_mj,
        second.violation_power_ns,
        0,
    )


POLICY_FINDINGS = {"repeat_offender", "validation_failed"}  # the policy's findings, not a rule's: no scenario


def readme_rule_ids() -> set[str]:
    """The rule ids of the rules page's table (docs/rules.md; first column, comma-separated ids in backticks)."""
    text = (ROOT / "docs" / "rules.md").read_text()
    table = text[text.index("| rule id |") :].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {rule for row in rows for rule in re.findall(r"`(\w+)`", row.split("|")[1])}


def test_every_rule_has_a_scenario_named_after_it() -> None:
    """One scenario per rule id of a GPU the engine has and the rules page promises, plus demo, healthy, idle and
    all_series (gpu_missing, on the node, is seen with fewer --sim-gpus than expected_gpus)."""
    assert readme_rule_ids() == {*ALL_RULE_IDS, *node.RULE_IDS, *POLICY_FINDINGS}
    assert set(SCENARIOS) == {"demo", "healthy", "idle", "all_series", *ALL_RULE_IDS}
    rule_fields = dataclasses.asdict(RulesConfig())
    for scenario in SCENARIOS.values():
        assert scenario.description
        for key, value in scenario.rules_overrides.items():
            assert key in rule_fields and value < rule_fields[key], (scenario.name, key)


def test_unknown_scenario_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown scenario 'nope' \(choose from demo, healthy, idle, sm_clock_low"):
        make("nope")


# Per scenario: what the faulty GPU's raw samples show, and the share of samples from t+10 that show it.
SAMPLE_FAULTS: dict[str, tuple[Callable[[GpuSample], bool], float]] = {
    "sm_clock_low_unexplained": (
        lambda s: s.util_gpu_pct == 100 and (s.sm_clock_mhz or 0) <= 510 and s.clocks_event_reasons == 0,
        1.0,
    ),
    "clocks_hw_slowdown": (lambda s: s.clocks_event_reasons == 0x8 and (s.sm_clock_mhz or 0) <= 705, 1.0),
    "clocks_hw_thermal": (lambda s: s.clocks_event_reasons == 0x40 and (s.sm_clock_mhz or 0) <= 900, 1.0),
    "clocks_hw_power_brake": (lambda s: s.clocks_event_reasons == 0x80 and (s.sm_clock_mhz or 0) <= 795, 1.0),
    "clocks_sw_thermal": (lambda s: s.clocks_event_reasons == 0x20 and (s.mem_temp_c or 0) >= 95, 1.0),
    "power_unstable": (
        lambda s: (
            (s.util_gpu_pct or 0) >= 90
            and (s.power_w or 0) < 145
            and (s.sm_clock_mhz or 0) < 1200
            and s.clocks_event_reasons == 0
        ),
        0.3,
    ),
    "ecc_uncorrectable": (lambda s: s.ecc_dbe_volatile == 1 and s.ecc_dbe_aggregate == 1, 1.0),
    "ecc_correctable_rate": (lambda s: (s.ecc_sbe_aggregate or 0) > 0 and (s.ecc_sbe_volatile or 0) > 0, 0.95),
    "row_remap_pending": (lambda s: s.remapped_pending == 1, 1.0),
    "row_remap_failure": (lambda s: s.remapped_failure == 1, 1.0),
    "thermal_margin_low": (lambda s: s.temp_c == 87, 1.0),
}


@pytest.mark.parametrize("name", sorted(SAMPLE_FAULTS))
def test_sample_fault_on_the_right_gpu_and_time(name: str) -> None:
    shows, share = SAMPLE_FAULTS[name]
    samples = run(make(name), 120)
    for index, per_gpu in samples.items():
        assert len(per_gpu) == 121
        before = [s for s in per_gpu if s.t < T0 + START_S]
        after = [s for s in per_gpu if s.t >= T0 + START_S]
        assert not any(shows(s) for s in before), index
        if index == FAULTY:
            assert sum(shows(s) for s in after) >= share * len(after)
        else:
            assert not any(shows(s) for s in after), index


def test_one_gpu_gets_the_fault_on_index_0() -> None:
    samples = run(make("row_remap_failure", gpus=1), 20, gpus=1)[0]
    assert samples[-1].remapped_failure == 1


def test_correctable_errors_rise_by_thousands_a_minute() -> None:
    backend = make("ecc_correctable_rate")
    first = backend.sample(FAULTY, T0)
    later = backend.sample(FAULTY, T0 + 70)
    assert first.ecc_sbe_aggregate == 0
    assert (later.ecc_sbe_aggregate or 0) >= 2000


READ_ERRORS = [("gpu_lost", "gpu_lost"), ("gpu_reset_required", "reset_required"), ("gpu_read_error", "unknown")]


@pytest.mark.parametrize(("name", "kind"), READ_ERRORS)
def test_read_error_scenarios_fail_reads_after_the_start(name: str, kind: str) -> None:
    backend = make(name)
    backend.sample(FAULTY, T0)
    backend.sample(FAULTY, T0 + 9)
    with pytest.raises(GpuReadError) as info:
        backend.sample(FAULTY, T0 + 10)
    assert info.value.kind == kind
    backend.sample(0, T0 + 60)


def test_idle_scenario_has_no_load_and_no_process() -> None:
    backend = make("idle")
    for t in (0, 100, 300):
        for index in range(4):
            s = backend.sample(index, T0 + t)
            assert (s.util_gpu_pct, s.pids, s.clocks_event_reasons) == (0, (), 0x1), s


def test_timeline_starts_at_the_first_now() -> None:
    backend = make("row_remap_failure")
    start = T0 + 5000
    assert backend.sample(FAULTY, start).remapped_failure == 0
    assert backend.sample(FAULTY, start + 9).remapped_failure == 0
    assert backend.sample(FAULTY, start + 10).remapped_failure == 1


def test_no_such_gpu() -> None:
    with pytest.raises(BackendError, match="no GPU 8"):
        make().sample(8, T0)


def events_until(backend: SimBackend, clock: ManualClock, t_rel: float) -> list[GpuEvent]:
    clock.t = T0 + t_rel
    out = backend.wait_events(0)
    assert all(isinstance(e, GpuEvent) for e in out)
    return [e for e in out if isinstance(e, GpuEvent)]


def test_xid_critical_event() -> None:
    clock = ManualClock(T0)
    backend = make("xid_critical", clock=clock)
    assert events_until(backend, clock, 9.9) == []
    (event,) = events_until(backend, clock, 10.0)
    assert (event.kind, event.xid, event.index, event.t) == ("xid", 79, FAULTY, T0 + 10)
    assert event.uuid == backend.open()[FAULTY].uuid
    assert events_until(backend, clock, 500) == []


def test_xid_app_repeated_every_20_s() -> None:
    clock = ManualClock(T0)
    backend = make("xid_app_repeated", clock=clock)
    events = events_until(backend, clock, 55)
    assert [(e.t - T0, e.xid, e.index) for e in events] == [(10, 31, 1), (30, 31, 1), (50, 31, 1)]
    assert [e.t - T0 for e in events_until(backend, clock, 70)] == [70]


def test_ecc_uncorrectable_event_and_counters_agree() -> None:
    clock = ManualClock(T0)
    backend = make("ecc_uncorrectable", clock=clock)
    backend.sample(FAULTY, T0)
    (event,) = events_until(backend, clock, 10)
    assert (event.kind, event.xid, event.index) == ("ecc_dbe", None, FAULTY)
    assert backend.sample(FAULTY, T0 + 10).ecc_dbe_aggregate == 1


def test_demo() -> None:
    clock = ManualClock(T0)
    backend = make("demo", clock=clock)
    assert SCENARIOS["demo"].rules_overrides == {"clock_window_s": 30.0}
    samples = run(backend, 120, 5)
    for index, per_gpu in samples.items():
        for s in per_gpu:
            slowed = s.clocks_event_reasons == 0x8 and 495 <= (s.sm_clock_mhz or 0) <= 705
            assert slowed == (index == 3 and s.t >= T0 + 20), (index, s.t - T0)
            assert s.ecc_dbe_aggregate == (1 if index == 5 and s.t >= T0 + 30 else 0)
    assert events_until(backend, clock, 29) == []
    (event,) = events_until(backend, clock, 31)
    assert (event.kind, event.index, event.t) == ("ecc_dbe", 5, T0 + 30)
    assert events_until(backend, clock, 600) == []


def test_demo_on_fewer_gpus_wraps_the_faulty_indexes() -> None:
    samples = run(make("demo", gpus=4), 40, 5, gpus=4)
    assert samples[3][-1].clocks_event_reasons == 0x8
    assert samples[1][-1].ecc_dbe_aggregate == 1


def test_wait_events_waits_for_the_next_event() -> None:
    offset = [0.0]
    backend = SimBackend(Config(sim=SimConfig(gpus=2, scenario="xid_critical")), clock=lambda: time.time() + offset[0])
    backend.open()
    offset[0] = START_S - 0.2
    started = time.monotonic()
    events = backend.wait_events(5)
    assert [e.kind for e in events] == ["xid"]
    assert 0.1 < time.monotonic() - started < 2


def test_wait_events_times_out_empty() -> None:
    backend = make()
    started = time.monotonic()
    assert backend.wait_events(0.1) == []
    assert 0.05 < time.monotonic() - started < 1


def test_close_wakes_wait_events() -> None:
    backend = make()
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(backend.wait_events(30)))
    thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    backend.close()
    thread.join(2)
    assert not thread.is_alive()
    assert time.monotonic() - started < 0.5
    assert result == [[]]
    backend.close()


def test_idle_pause_is_scheduled() -> None:
    backend = make()
    backend.sample(0, T0)
    busy = backend.sample(0, T0 + BUSY_S - 1)
    idle = backend.sample(0, T0 + BUSY_S + 10)
    assert busy.util_gpu_pct and not idle.util_gpu_pct
    assert (idle.sm_clock_mhz, idle.clocks_event_reasons) == (345, 1)
    assert backend.sample(0, T0 + CYCLE_S + 1).util_gpu_pct
