"""The interference bench's parts that decide its figures: the statistics, the order of the run, the CPUs
chosen, the daemon variants' NVML calls, the call helper's pacing and event sets, a restarted monitor,
and the section's flags (the whole section runs in the bench smoke test, tests/bench/test_bench.py)."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.backends import nvml_plan
from gpuwatch.bench import stats
from gpuwatch.bench.interference import cpus, variants
from gpuwatch.bench.interference.beside import CommandLoop, Monitor, kernel_log_facts
from gpuwatch.bench.interference.caller import EVENT_KINDS, NVML_KINDS, CallerProcess, Calls
from gpuwatch.bench.interference.plan import interleave, round_seconds, rounds_within
from gpuwatch.bench.interference.runner import ALONE_SETTLE_S, differences, planned_round_s, summarize, time_segments
from gpuwatch.bench.stats import ALONE, Steps
from gpuwatch.config import Config
from gpuwatch.testing.daemon_process import ServerProcess, free_port
from tests.fakes import fake_pynvml as fake
from tests.fakes.fake_pynvml import PROCESS_COUNT, FakeGpu, FakeNvml

XID, DBE = fake.nvmlEventTypeXidCriticalError, fake.nvmlEventTypeDoubleBitEccError
SBE = fake.nvmlEventTypeSingleBitEccError


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
    """Each condition's pair costs its two segments and its overhead (a restarted monitor's start, the settles)."""
    assert round_seconds(3.0, [0.5, 0.5, 2.1]) == 3 * 6.0 + 3.1
    assert rounds_within(150.0, 21.1) == 7
    assert rounds_within(0.0, 21.1) == 2
    assert rounds_within(10.0, 21.1, least=1) == 1
    assert rounds_within(10.0, 0.0) == 2


def test_planned_rounds_count_each_monitors_start() -> None:
    class Started:
        settle_s, start_s = 0.5, 1.5

    assert planned_round_s([Started(), Started()], 3.0) == pytest.approx(2 * (6.0 + 0.5 + 1.5 + ALONE_SETTLE_S))


def test_two_conditions_compare_round_by_round() -> None:
    """A disturbance that falls on both conditions of a round cancels in their difference, not in either ratio."""
    keys = interleave(["x", "y"], 4, 1.0)
    wobble = [1.0, 1.03, 0.97, 1.0]  # what each round does to the conditions' segments (mean 1)
    cost = {"x": 1.005, "y": 1.002}
    timed = [(s.key, [0.001 * (1.0 if s.key == ALONE else wobble[s.round] * cost[s.key])] * 10) for s in keys]
    found = differences(timed, [("x", "y", "x minus y"), ("x", "absent", "never ran")])
    assert list(found) == ["x-y"] and found["x-y"]["label"] == "x minus y"
    x_alone = summarize(timed, {})["x"]["mean_vs_alone"]
    for stat in ("p50", "mean"):
        diff = found["x-y"][stat]
        assert diff["pct"] == pytest.approx(0.3) and diff["pairs"] == 4
        assert diff["high_pct"] - diff["low_pct"] < (x_alone["high_pct"] - x_alone["low_pct"]) / 50
    assert stats.difference([1.01, 1.03], [1.0, 1.0]).as_pct()["pct"] == pytest.approx(2.0)


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
    through_backend = {"sample_before", "sample_after", *EVENT_KINDS}
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


def test_the_helpers_event_kinds_hold_the_set_they_name_for_their_segment_only() -> None:
    """The probe's set is what gpuwatch registered before nvml.events (XID and both ECC types); event_set_xid
    is XIDs only; either is freed when its segment ends, so no alone segment has one."""
    nvml = FakeNvml([FakeGpu(supported_events=XID | DBE | SBE)])
    calls = Calls("nvml", 0, 1)
    nvml.nvmlInit()
    calls.opened["pynvml"] = (nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    for kind, mask in (("event_set_idle", XID | DBE | SBE), ("event_set_xid", XID)):
        assert calls.make(kind) is None  # holds the set, makes no call
        assert nvml.event_sets[-1].masks == {0: mask} and not nvml.event_sets[-1].freed
        calls.end()
        assert nvml.event_sets[-1].freed
    wait = calls.make("event_wait_5ms")
    assert wait is not None and wait() == [] and nvml.waits[-1] == 5
    calls.end()
    assert nvml.initialized == 1  # the helper's own NVML stays open between segments


def _file_server(root: Path, body: str) -> ServerProcess:
    """A real HTTP server answering GET /metrics with `body` (a stand-in monitor that starts in a blink)."""
    (root / "metrics").write_text(body)
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)]
    return ServerProcess("file server", argv, port, root / "server.log")


def test_a_restarted_monitor_runs_during_its_segments_only(tmp_path: Path) -> None:
    server = _file_server(tmp_path, "# TYPE gpuwatch_kernel_log_readable gauge\ngpuwatch_kernel_log_readable 1.0\n")
    monitor = Monitor("m", "a monitor", server, scrape_s=0.05, facts=kernel_log_facts)
    monitor.open()
    assert server.process.poll() is not None and monitor.start_s > 0  # started once to time it, then killed
    monitor.resume()
    assert server.process.poll() is None
    time.sleep(0.3)
    monitor.pause()
    assert server.process.poll() is not None
    figures = monitor.close()
    assert figures["starts"] == 2 and figures["died_in_segments"] == 0 and figures["scrapes"] > 0
    assert figures["kernel_log_readable"] is True and figures["start_s_p50"] > 0


def test_kernel_log_facts_without_the_gauge_are_unknown(tmp_path: Path) -> None:
    with _file_server(tmp_path, "# a sim daemon has no kernel log\n") as server:
        assert kernel_log_facts(server, wait_s=0.3) == {"kernel_log_readable": None}
    assert kernel_log_facts(server, wait_s=0.1) == {"kernel_log_readable": None}  # nothing listens now


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--interference-conditions", "gpuwatch_1s,nope", "--interference-conditions: unknown name(s) nope"),
        ("--interference-steps", ",", "--interference-steps: no name given"),
    ],
)
def test_bad_interference_lists_are_one_line_and_exit_2(flag: str, value: str, message: str) -> None:
    from click.testing import CliRunner

    from gpuwatch.bench.cli import bench

    result = CliRunner().invoke(bench, ["--backend", "sim", "--only", "interference", flag, value])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpuwatch: error: {message} (choose from "), result.stderr


def test_interference_lists_keep_their_run_order() -> None:
    from gpuwatch.bench.cli import parse_names

    assert parse_names("--x", "long, short", ("short", "long")) == ("short", "long")
    assert parse_names("--x", "all", ("short", "long")) == ("short", "long")
    assert parse_names("--x", None, ("short", "long")) is None


def test_a_condition_that_does_not_resume_loses_its_segment_and_its_rounds_pairing() -> None:
    """A restarted monitor that fails to start once: its segment is left out, the others are timed, and the
    round-by-round difference with it is not reported (its ratios no longer pair by round)."""

    class Job:
        def start(self) -> None:
            pass

        def stop(self) -> list[float]:
            return [0.001] * 5

    class Flaky:
        key, label, settle_s, start_s = "x", "x", 0.0, 0.0
        resumes = 0

        def resume(self) -> None:
            self.resumes += 1
            if self.resumes == 2:
                raise RuntimeError("exited with code 1")

        def pause(self) -> None:
            pass

    class Steady(Flaky):
        key = label = "y"

        def resume(self) -> None:
            pass

    segments = interleave(["x", "y"], 3, 0.001)
    timed = time_segments(Job(), segments, {"x": Flaky(), "y": Steady()}, "test")  # type: ignore[dict-item]
    assert [key for key, _ in timed].count("x") == 2 and [key for key, _ in timed].count("y") == 3
    assert len(timed) == len(segments) - 1
    assert differences(timed, [("x", "y", "x minus y")]) == {}
