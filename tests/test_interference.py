"""The interference bench's parts that decide its figures: the statistics, the order of the run, the CPUs
chosen, the daemon variants' NVML calls, and the call helper's pacing (the whole section runs in the
bench smoke test, tests/test_bench.py)."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.backends import nvml_plan
from gpuwatch.bench.interference import cpus, stats, variants
from gpuwatch.bench.interference.beside import CommandLoop
from gpuwatch.bench.interference.caller import NVML_KINDS, CallerProcess, Calls
from gpuwatch.bench.interference.plan import interleave, round_seconds, rounds_within
from gpuwatch.bench.interference.runner import summarize
from gpuwatch.bench.interference.stats import ALONE, Steps
from gpuwatch.config import Config
from tests.fakes.fake_pynvml import PROCESS_COUNT, FakeNvml


def _flat(value: float) -> Steps:
    """A segment whose every step took `value` seconds."""
    return Steps(100, value, value, value, value)


def test_interval_is_the_t_interval_of_the_pair_ratios() -> None:
    two = stats.interval([1.01, 1.03])  # mean 1.02, sd 0.01414, se 0.01, t(1) 12.706
    assert two.mean == pytest.approx(1.02) and two.pairs == 2
    assert (two.low, two.high) == (pytest.approx(1.02 - 0.12706), pytest.approx(1.02 + 0.12706))
    three = stats.interval([1.0, 1.01, 1.02])  # sd 0.01, se 0.005774, t(2) 4.303
    assert three.high - three.mean == pytest.approx(4.303 * 0.01 / math.sqrt(3))  # type: ignore[operator]
    one = stats.interval([1.004])
    assert (one.low, one.high, one.pairs) == (None, None, 1)
    pct = two.as_pct()
    assert pct["pct"] == pytest.approx(2.0) and pct["low_pct"] == pytest.approx(2.0 - 12.706)


def test_t_quantiles() -> None:
    assert stats.t_975(1) == 12.706 and stats.t_975(4) == 2.776 and stats.t_975(30) == 2.042
    assert stats.t_975(60) == pytest.approx(2.000, abs=0.002) and stats.t_975(1000) == pytest.approx(1.962, abs=0.002)
    with pytest.raises(ValueError):
        stats.t_975(0)


def test_pairs_cancel_a_linear_drift() -> None:
    """The card slows steadily through the run (clocks, heat); a condition 5 % slower still reads 5 %,
    and alone against the alone segments two places away reads 0 %."""
    keys = interleave(["x", "y"], 3, 1.0)
    drift = [1.0 + 0.01 * i for i in range(len(keys))]  # the alone step time at each position
    slower = {ALONE: 1.0, "x": 1.05, "y": 1.0}
    segments = [(s.key, _flat(drift[i] * slower[s.key])) for i, s in enumerate(keys)]
    ratios = stats.paired_ratios(segments, "mean")
    assert ratios["x"] == [pytest.approx(1.05)] * 3
    assert ratios["y"] == [pytest.approx(1.0)] * 3
    assert ratios[ALONE] == [pytest.approx(1.0)] * len(ratios[ALONE])
    assert len(ratios[ALONE]) == 5  # the 7 alone segments but the first and the last, which have one side only


def test_summary_of_a_run_with_a_known_cost() -> None:
    """Steps 2 % slower beside x in every round: +2 % with a zero-width interval; the pooled figures in ms."""
    timed = []
    for segment in interleave(["x"], 3, 1.0):
        base = [0.001] * 90 + [0.002] * 10  # p50 1 ms, mean 1.1 ms, p99 2 ms
        factor = 1.02 if segment.key == "x" else 1.0
        timed.append((segment.key, [step * factor for step in base]))
    summary = summarize(timed, {"x": "beside x"})
    x = summary["x"]
    assert x["label"] == "beside x" and x["segments"] == 3 and x["n"] == 300
    assert (x["p50_ms"], x["mean_ms"], x["p99_ms"]) == (pytest.approx(1.02), pytest.approx(1.122), pytest.approx(2.04))
    for stat in ("p50", "mean"):
        cost = x[f"{stat}_vs_alone"]
        assert cost["pct"] == pytest.approx(2.0) and cost["pairs"] == 3
        assert cost["low_pct"] == pytest.approx(2.0) and cost["high_pct"] == pytest.approx(2.0)
    assert summary[ALONE]["mean_vs_alone"] == {
        "pct": pytest.approx(0.0),
        "low_pct": pytest.approx(0.0),
        "high_pct": pytest.approx(0.0),
        "pairs": 2,
    }
    assert summary[ALONE]["segments"] == 4


def test_summarize_steps_rejects_an_empty_segment() -> None:
    with pytest.raises(ValueError, match="no step"):
        stats.summarize_steps([])


def test_interleave_puts_alone_around_every_condition_and_turns_the_order() -> None:
    segments = interleave(["a", "b", "c"], 3, 2.0)
    assert [s.key for s in segments] == [
        ALONE, "a", ALONE, "b", ALONE, "c", ALONE,
        "b", ALONE, "c", ALONE, "a", ALONE,
        "c", ALONE, "a", ALONE, "b", ALONE,
    ]  # fmt: skip
    assert [s.round for s in segments if s.key != ALONE] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(s.seconds == 2.0 for s in segments)
    longer = interleave(["a", "b"], 1, 1.0, {"b": 4.0})
    assert [(s.key, s.seconds) for s in longer] == [(ALONE, 1.0), ("a", 1.0), (ALONE, 1.0), ("b", 4.0), (ALONE, 4.0)]
    with pytest.raises(ValueError):
        interleave([], 2, 1.0)


def test_rounds_fit_the_budget_and_never_fall_below_two() -> None:
    assert round_seconds(4, 3.0, 0.5) == 28.0
    assert rounds_within(150.0, 4, 3.0, 0.5) == 5
    assert rounds_within(0.0, 4, 3.0, 0.5) == 2
    assert rounds_within(10.0, 4, 3.0, 0.5, least=1) == 1


def test_cpu_lists_round_trip() -> None:
    assert cpus.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpus.cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert cpus.cpu_list(set()) == ""


def _sysfs(tmp_path: Path, siblings: dict[int, str], local: str) -> tuple[Path, Path]:
    sys_cpu, sys_pci = tmp_path / "cpu", tmp_path / "pci"
    for cpu, text in siblings.items():
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")
    device = sys_pci / "0000:00:06.0"
    device.mkdir(parents=True)
    (device / "local_cpulist").write_text(local + "\n")
    return sys_cpu, sys_pci


def test_job_cpu_is_local_to_the_gpu_with_its_siblings_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 CPUs, SMT pairs (n, n+4), the GPU local to CPUs 0-1 and 4-5: the job on 5, CPU 1 idle."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    pairs = {n: f"{n % 4},{n % 4 + 4}" for n in range(8)}
    sys_cpu, sys_pci = _sysfs(tmp_path, pairs, "0-1,4-5")
    placement = cpus.place("00000000:00:06.0", sys_cpu, sys_pci)
    assert (placement.job, placement.idle, placement.others) == (5, {1}, {0, 2, 3, 4, 6, 7})
    assert "local to the GPU" in placement.why
    assert placement.as_dict() == {"job_cpu": 5, "idle_cpus": "1", "monitor_cpus": "0,2-4,6-7"}
    without_gpu = cpus.place("", sys_cpu, sys_pci)
    assert (without_gpu.job, without_gpu.idle) == (7, {3})


def test_two_threads_of_one_core_still_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    sys_cpu, sys_pci = _sysfs(tmp_path, {0: "0-1", 1: "0-1"}, "0-1")
    placement = cpus.place("", sys_cpu, sys_pci)
    assert (placement.job, placement.idle, placement.others) == (1, frozenset(), {0})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert cpus.place("", sys_cpu, sys_pci).job is None


def test_variant_without_events_makes_no_event_call() -> None:
    nvml = FakeNvml()
    backend = variants.NvmlWithoutEvents(Config(), nvml)
    backend.open()
    assert backend.wait_events(0.01) == []
    assert nvml.calls["nvmlEventSetCreate"] == 0 and nvml.calls["nvmlEventSetWait_v2"] == 0
    assert backend.sample(0, 1.0).sm_clock_mhz == 1425


def test_variant_events_only_reads_each_gpu_once() -> None:
    nvml = FakeNvml()
    backend = variants.NvmlEventsOnly(Config(), nvml)
    backend.open()
    first = backend.sample(0, 1.0)
    calls = sum(nvml.calls.values())
    later = backend.sample(0, 2.0)
    assert sum(nvml.calls.values()) == calls and later.t == 2.0 and later.sm_clock_mhz == first.sm_clock_mhz
    assert first.energy_mj is not None  # the one read is a slow sample: every field the daemon shows
    backend.wait_events(0)
    assert nvml.calls["nvmlEventSetWait_v2"] == 1


def test_variant_before_plan_lists_processes_every_sample() -> None:
    nvml = FakeNvml()
    backend = variants.NvmlBeforePlan(Config(), nvml)
    backend.open()
    for t in range(3):
        backend.sample(0, float(t))
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 3 and nvml.calls[PROCESS_COUNT] == 0
    assert variants.backend_name(variants.NvmlBeforePlan) == "gpuwatch.bench.interference.variants:NvmlBeforePlan"


def test_call_kinds_follow_the_read_plan() -> None:
    """The attribution scales each call by how often the daemon makes it: now and before the read plan."""
    per_s = {kind.name: kind.per_s for kind in NVML_KINDS}
    now, before = nvml_plan.DEFAULT, nvml_plan.BEFORE
    assert per_s["procs_list"] is not None and per_s["procs_count"] is not None
    assert (per_s["procs_list"](before), per_s["procs_count"](before)) == (1.0, 0.0)
    assert (per_s["procs_list"](now), per_s["procs_count"](now)) == (1 / 30, 1.0)
    assert per_s["pcie_gen"](now) == 1 / 5 and per_s["pcie_gen"](before) == 1.0  # type: ignore[misc]
    assert per_s["ecc_aggregate"](now) == 2 / 60 and per_s["ecc_volatile"](now) == 2  # type: ignore[misc]
    assert per_s["event_wait_500ms"] is None  # its own pace is the daemon's


@pytest.mark.slow
def test_call_helper_keeps_its_rate_and_says_what_it_cannot_call(tmp_path: Path) -> None:
    caller = CallerProcess("sim", 0, 1, tmp_path / "caller.stderr")
    try:
        assert caller.probe("sample_sim") == ""
        assert "KeyError" in caller.probe("energy")  # not a call of the sim backend
        caller.run("sample_sim", 100.0)
        time.sleep(0.5)
        calls, seconds, errors = caller.stop()
        assert errors == 0 and 0 < calls <= 100.0 * seconds + 2
    finally:
        caller.close()


def test_every_call_kind_names_real_pynvml_functions() -> None:
    """A misspelt function would cost a GPU run its figure: each kind's call is built against pynvml's own names."""
    pynvml = pytest.importorskip("pynvml")

    class Checked:
        def __getattr__(self, name: str) -> object:
            real = getattr(pynvml, name)  # AttributeError: no such name in the binding
            return (lambda *args: name) if callable(real) else real

    class Old(Checked):
        def __getattr__(self, name: str) -> object:
            if name == "nvmlDeviceGetRunningProcessDetailList":
                raise AttributeError(name)
            return super().__getattr__(name)

    old = Calls("nvml", 0, 1)
    old.opened["pynvml"] = (Old(), object())
    with pytest.raises(AttributeError):
        old.make("procs_detail")
    assert old.make("energy") is not None  # a binding without one call loses that kind only
    calls = Calls("nvml", 0, 1)
    calls.opened["pynvml"] = (Checked(), object())
    through_backend = {"sample_before", "sample_after", "event_set_idle", "event_wait_500ms", "event_wait_5ms"}
    made = {kind.name: calls.make(kind.name) for kind in NVML_KINDS if kind.name not in through_backend}
    assert len(made) == len(NVML_KINDS) - len(through_backend)
    assert all(callable(call) for call in made.values())
    assert made["energy"]() == "nvmlDeviceGetTotalEnergyConsumption"  # type: ignore[misc]


def test_command_loop_runs_only_between_resume_and_pause() -> None:
    """nvidia-smi's stand-in: a command every `every_s` while its condition is timed, none after."""
    loop = CommandLoop("cmd", "a command", [sys.executable, "-c", "pass"], 0.05)
    loop.open()
    loop.resume()
    time.sleep(0.5)
    loop.pause()
    figures = loop.close()
    time.sleep(0.2)
    assert figures["calls"] > 0 and figures["failures"] == 0 and figures["call_p50_ms"] > 0
    assert loop.close()["calls"] == figures["calls"]  # nothing ran after the pause
