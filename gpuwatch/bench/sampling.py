"""Sampling: what one full gpuwatch sample costs per GPU against the NVML floor, and what a tick costs the daemon.

The floor is the same NVML calls NvmlBackend.sample makes, called bare on the handles in a tight
loop: the cost no NVML-based sampler can go under. The full sample and the floor alternate GPU by GPU
so both see the same machine. On the sim backend there are no NVML calls: the floor is the sim's own
sample, so the ratio only shows the harness's noise.

A tick (Monitor.tick: sample every GPU, judge with every rule, step the state machine, build the
Snapshot, sync findings to SQLite, write status.json) is what the daemon pays every interval. Its
cost grows with the history the rules look back over, which fills for the longest rule window
(ecc_window_s, an hour by default), so it is measured with the history already at its steady length.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from gpuwatch.backends.base import Backend
from gpuwatch.bench.harness import Context, progress, summarize
from gpuwatch.bench.report import REFERENCE, REFERENCE_SOURCE, Row, Section, not_applicable, ratio, target
from gpuwatch.config import Config, SimConfig
from gpuwatch.health import engine
from gpuwatch.metrics import MetricsRenderer, SnapshotCollector
from gpuwatch.model import GpuSample, GpuStatic
from gpuwatch.monitor import Monitor
from gpuwatch.runtime import RuntimeDir
from gpuwatch.store import Store

FLOOR_TARGET_RATIO = 3.0
Call = tuple[Callable[..., Any], tuple[Any, ...]]


class FakeClock:
    """Time that moves only when told: ticks can then be as far apart as the interval without waiting."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def bench_config(ctx: Context, interval_s: float = 1.0) -> Config:
    return Config(backend=ctx.backend, interval_s=interval_s, sim=SimConfig(gpus=ctx.gpus, scenario="healthy"))


def open_backend(
    ctx: Context, config: Config, clock: Callable[[], float] = time.time
) -> tuple[Backend, list[GpuStatic]]:
    """The bench's backend, opened, and the statics of the GPUs it measures (the first ctx.gpus).

    Raises:
        BackendUnavailable: NVML (or the driver, or a GPU) is not there.
    """
    backend: Backend
    if ctx.backend == "sim":
        from gpuwatch.backends.sim import SimBackend

        backend = SimBackend(config, clock=clock)
    else:
        from gpuwatch.backends.nvml import NvmlBackend

        backend = NvmlBackend(config)
    statics = list(backend.open())[: ctx.gpus]
    return backend, statics


def run(ctx: Context) -> Section:
    section = Section("sampling")
    rounds = int(ctx.pick(2000, 200))
    backend, statics = open_backend(ctx, bench_config(ctx))
    try:
        progress(f"sampling: {len(statics)} GPU(s) × {rounds} rounds, full sample against the floor")
        floors = _floor_calls(ctx, backend, statics)
        full, floor = _sample_costs(backend, statics, floors, rounds)
    finally:
        backend.close()
    full_s, floor_s = summarize(full, "us"), summarize(floor, "us")
    calls = len(next(iter(floors.values())))
    section.figures = {
        "rounds": rounds,
        "full_sample_us": full_s,
        "floor_us": floor_s,
        "floor_kind": "sim sample (no NVML)" if ctx.backend == "sim" else f"{calls} bare NVML calls",
        "ratio_mean": ratio(full_s["mean_us"], floor_s["mean_us"]),
        "ratio_p99": ratio(full_s["p99_us"], floor_s["p99_us"]),
    }
    rows = section.rows
    rows.append(Row("full sample per GPU, p99", full_s["p99_us"], "µs"))
    rows.append(Row(f"floor per GPU, mean ({section.figures['floor_kind']})", floor_s["mean_us"], "µs"))
    if ctx.backend == "sim":
        why = "sim has no NVML; floor = sim sample"
        rows.insert(0, not_applicable("full sample per GPU, mean", full_s["mean_us"], "µs", why))
        rows.append(not_applicable("full / floor, mean", section.figures["ratio_mean"], "×", why))
    else:
        limit = FLOOR_TARGET_RATIO * REFERENCE["nvml_floor_us"]
        rows.insert(0, target("full sample per GPU, mean", full_s["mean_us"], "µs", limit, against=REFERENCE_SOURCE))
        rows.append(target("full / floor, mean", section.figures["ratio_mean"], "×", FLOOR_TARGET_RATIO))
    rows.append(Row("full / floor, p99", section.figures["ratio_p99"], "×"))
    ticks: dict[str, Any] = {}
    for interval_s in (1.0, 30.0):
        tick = _tick_cost(ctx, interval_s, int(ctx.pick(200, 30)))
        ticks[f"{interval_s:g}s"] = tick
        label = f"at {interval_s:g} s ({tick['history_s']:g} s of history)"
        rows.append(Row(f"Monitor.tick per GPU {label}", tick["tick_per_gpu_us"], "µs"))
        rows.append(Row(f"tick CPU {label}", tick["core_pct"], "% core"))
    rows.append(Row("/metrics render per Snapshot", ticks["1s"]["render_ms"]["mean_ms"], "ms"))
    section.figures["tick"] = ticks
    section.notes.append(
        "a tick = sample + rules + state machine + Snapshot + SQLite findings sync + status.json, "
        "measured with the rules' history at its steady length (longest window + 2 intervals)"
    )
    return section


def _floor_calls(ctx: Context, backend: Backend, statics: list[GpuStatic]) -> dict[int, list[Call]]:
    """Per GPU, the bare calls of the floor: NvmlBackend.sample's NVML calls, or the sim's sample itself."""
    if ctx.backend == "sim":
        return {s.index: [(backend.sample, (s.index, time.time()))] for s in statics}
    import pynvml

    nv: Any = pynvml
    names = ("NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_POWER_INSTANT")
    fields = [getattr(nv, name) for name in names if hasattr(nv, name)]
    corrected, uncorrected = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    ecc = nv.nvmlDeviceGetTotalEccErrors
    floors: dict[int, list[Call]] = {}
    for static in statics:
        h = nv.nvmlDeviceGetHandleByIndex(static.index)
        calls: list[Call] = [
            (nv.nvmlDeviceGetUtilizationRates, (h,)),
            (nv.nvmlDeviceGetMemoryInfo, (h,)),
            (nv.nvmlDeviceGetPowerUsage, (h,)),
            (nv.nvmlDeviceGetPerformanceState, (h,)),
            (nv.nvmlDeviceGetRemappedRows, (h,)),
            (nv.nvmlDeviceGetComputeRunningProcesses, (h,)),
            (nv.nvmlDeviceGetClockInfo, (h, nv.NVML_CLOCK_SM)),
            (nv.nvmlDeviceGetClockInfo, (h, nv.NVML_CLOCK_MEM)),
            (nv.nvmlDeviceGetTemperature, (h, nv.NVML_TEMPERATURE_GPU)),
            (nv.nvmlDeviceGetCurrentClocksEventReasons, (h,)),
            (ecc, (h, corrected, nv.NVML_VOLATILE_ECC)),
            (ecc, (h, uncorrected, nv.NVML_VOLATILE_ECC)),
            (ecc, (h, corrected, nv.NVML_AGGREGATE_ECC)),
            (ecc, (h, uncorrected, nv.NVML_AGGREGATE_ECC)),
        ]
        if fields:
            calls.append((nv.nvmlDeviceGetFieldValues, (h, fields)))
        floors[static.index] = [call for call in calls if _supported(nv, call)]
    return floors


def _supported(nv: Any, call: Call) -> bool:
    """The backend stops reading a field its GPU does not support; the floor leaves that call out too."""
    fn, args = call
    try:
        fn(*args)
    except nv.NVMLError:
        return False
    return True


def _sample_costs(
    backend: Backend, statics: list[GpuStatic], floors: dict[int, list[Call]], rounds: int
) -> tuple[list[float], list[float]]:
    """Seconds per GPU of backend.sample and of the bare floor, alternating, after a warm-up."""
    full: list[float] = []
    floor: list[float] = []
    perf = time.perf_counter
    for n in range(rounds + 20):
        for static in statics:
            calls = floors[static.index]
            start = perf()
            for fn, args in calls:
                fn(*args)
            middle = perf()
            backend.sample(static.index, time.time())
            end = perf()
            if n >= 20:  # the first rounds learn unsupported fields and warm caches
                floor.append(middle - start)
                full.append(end - middle)
    return full, floor


def _tick_cost(ctx: Context, interval_s: float, ticks: int) -> dict[str, Any]:
    """Monitor.tick (with SQLite and status.json, as in the daemon) and the render after it, at steady history."""
    root = ctx.workdir / f"tick-{interval_s:g}s"
    clock = FakeClock(time.time())
    config = dataclasses.replace(
        bench_config(ctx, interval_s), state_dir=str(root / "state"), runtime_dir=str(root / "run")
    )
    backend, statics = open_backend(ctx, config, clock)
    runtime = RuntimeDir(config.runtime_dir)
    runtime.prepare()
    store = Store(config.db_path)
    try:
        monitor = Monitor(backend, statics, config, store=store, runtime=runtime, clock=clock)
        history_s = engine.max_window_s(monitor.rules) + 2 * interval_s
        _fill_history(monitor, backend, statics, clock, interval_s, math.ceil(history_s / interval_s))
        renderer = MetricsRenderer(SnapshotCollector(lambda: monitor.snapshot), key=lambda: id(monitor.snapshot))
        tick_s: list[float] = []
        render_s: list[float] = []
        for _ in range(ticks):
            clock.t += interval_s
            start = time.perf_counter()
            monitor.tick()
            middle = time.perf_counter()
            renderer.render()
            render_s.append(time.perf_counter() - middle)
            tick_s.append(middle - start)
    finally:
        store.close()
        backend.close()
    stats = summarize(tick_s, "ms")
    return {
        "interval_s": interval_s,
        "history_s": history_s,
        "tick_ms": stats,
        "tick_per_gpu_us": stats["mean_ms"] * 1e3 / len(statics),
        "render_ms": summarize(render_s, "ms"),
        "cpu_s_per_hour": stats["mean_ms"] / 1e3 * 3600 / interval_s,
        "core_pct": stats["mean_ms"] / 1e3 / interval_s * 100,
    }


def _fill_history(
    monitor: Monitor, backend: Backend, statics: list[GpuStatic], clock: FakeClock, interval_s: float, steps: int
) -> None:
    """Feed `steps` rounds of one real round's readings, re-stamped, with rules, SQLite and status.json off.

    The cost of a tick depends on how many readings the rules walk, not on their values, and judging
    each of the thousands of warm-up rounds would take minutes; so they are only recorded.
    """
    readings: list[GpuSample] = [backend.sample(s.index, clock()) for s in statics]
    rules, store, runtime = monitor.rules, monitor.store, monitor.runtime
    monitor.rules = dataclasses.replace(rules, disabled=tuple(engine.module_name(m) for m in engine.RULE_MODULES))
    monitor.store = monitor.runtime = None
    try:
        for _ in range(steps):
            clock.t += interval_s
            monitor.judge_readings([dataclasses.replace(r, t=clock.t) for r in readings])
    finally:
        monitor.rules, monitor.store, monitor.runtime = rules, store, runtime
