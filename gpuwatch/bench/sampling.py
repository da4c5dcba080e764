"""Sampling: what one full gpuwatch sample costs per GPU against the NVML floor, and what a tick costs the daemon.

The floor is the same NVML calls NvmlBackend.sample makes, called bare on the handles in a tight
loop: the cost no NVML-based sampler can go under. The full sample and the floor alternate GPU by GPU
so both see the same machine. On the sim backend there are no NVML calls: the floor is the sim's own
sample, so the ratio only shows the harness's noise.

A tick (Monitor.tick: sample every GPU, judge with every rule, step the state machine, build the
Snapshot, sync findings to SQLite, write status.json) is what the daemon pays every interval. The rules
judge a running state updated once per sample (health/running.py), so a tick should cost the same with
no history and with the longest rule window (an hour) behind it: the growth table measures it at 0,
10 min and 1 h of history for 1, 8 and 64 GPUs (sim; nvml: 1 and the GPUs there are), with the bytes of
rule state each GPU holds, and the windowed reference's rule cost beside the running state's at each
history length (one GPU, rules only) to show the slope the running state removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwatch.backends.base import Backend
from gpuwatch.base.clock import ManualClock
from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.report import REFERENCE, REFERENCE_SOURCE, Row, Section, not_applicable, ratio, target
from gpuwatch.bench.stats import summarize
from gpuwatch.config import Config, RulesConfig, SimConfig
from gpuwatch.health import engine
from gpuwatch.health.history import History
from gpuwatch.health.running import RunningState
from gpuwatch.model import GpuSample, GpuStatic
from gpuwatch.node.monitor import Monitor
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.node.store import Store
from gpuwatch.serving.metrics import MetricsRenderer, SnapshotCollector

FLOOR_TARGET_RATIO = 3.0
TICK_TARGET_US = 150.0  # per GPU with a full hour of history (on an H200)
FLAT_RATIO = 1.1  # the tick with an hour of history against none
HISTORIES_S = (0.0, 600.0, 3600.0)
SIM_GPU_COUNTS = (1, 8, 64)
WARM_UP_TICKS = 5
Call = tuple[Callable[..., Any], tuple[Any, ...]]


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
    section.figures["growth"] = _growth(ctx, rows)
    section.figures["rules_only"] = _rules_only(ctx, rows)
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


def _growth(ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
    """Tick cost per GPU and rule state per GPU against history length and GPU count, at a 1 s interval.

    The three history lengths of one GPU count tick in turn (none, 10 min, 1 h, then the next round
    in a rotated order), so a machine that slows down or speeds up during the cells moves them alike
    and their ratio stays the code's.
    """
    counts = SIM_GPU_COUNTS if ctx.backend == "sim" else tuple(sorted({1, ctx.gpus}))
    if ctx.quick:
        counts = tuple(sorted({1, min(ctx.gpus, max(counts))}))
    ticks = int(ctx.pick(200, 10))
    cells = []
    for gpus in counts:
        progress(f"sampling: tick with {gpus} GPU(s) at {', '.join(_history(h) for h in HISTORIES_S)}, interleaved")
        with contextlib.ExitStack() as stack:
            rigs = [stack.enter_context(_TickRig(dataclasses.replace(ctx, gpus=gpus), 1.0, h)) for h in HISTORIES_S]
            times: list[list[float]] = [[] for _ in rigs]
            for n in range(WARM_UP_TICKS + ticks):
                order = list(range(len(rigs)))
                order = order[n % len(order) :] + order[: n % len(order)]
                for k in order:
                    took = rigs[k].tick()
                    if n >= WARM_UP_TICKS:
                        times[k].append(took)
            nbytes = [rig.history_bytes_per_gpu() for rig in rigs]
        flat: list[float] = []
        for history_s, tick_s, per_gpu_bytes in zip(HISTORIES_S, times, nbytes, strict=True):
            per_gpu = summarize(tick_s, "us")["p50_us"] / gpus
            flat.append(per_gpu)
            cells.append(
                {"gpus": gpus, "history_s": history_s, "tick_per_gpu_us": per_gpu, "bytes_per_gpu": per_gpu_bytes}
            )
            label = f"tick per GPU (median), {gpus} GPU(s), {_history(history_s)}"
            if history_s == HISTORIES_S[-1] and ctx.backend == "nvml":
                rows.append(target(label, per_gpu, "µs", TICK_TARGET_US))
            else:
                rows.append(Row(label, per_gpu, "µs"))
        rows.append(
            target(f"tick per GPU, {gpus} GPU(s): 1 h of history / none", ratio(flat[-1], flat[0]), "×", FLAT_RATIO)
        )
        rows.append(Row(f"rule state per GPU, {gpus} GPU(s), 1 h", cells[-1]["bytes_per_gpu"] / 1024, "KiB"))
    return cells


def _rules_only(ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
    """One GPU's rules alone, running state against the windowed reference, at each history length.

    The same sample repeated with fresh timestamps (a healthy card, so no rule fires): what each pays
    to reach its verdict, not what a finding costs to word.
    """
    cfg = RulesConfig()
    backend, statics = open_backend(dataclasses.replace(ctx, gpus=1), bench_config(ctx))
    try:
        static = statics[0]
        reading = backend.sample(static.index, time.time())
    finally:
        backend.close()
    keep_s = engine.max_window_s(cfg) + 2.0
    reps = int(ctx.pick(200, 20))
    results = []
    for history_s in HISTORIES_S:
        t0 = time.time()
        samples = [dataclasses.replace(reading, t=t0 + i) for i in range(int(history_s) + 1)]
        running = RunningState(static, engine.conditions(static, cfg), keep_s)
        for sample in samples:
            running.add(sample)
        now = samples[-1].t
        history = History(static=static, now=now, samples=tuple(samples), baseline=samples[0])
        perf = time.perf_counter
        start = perf()
        for _ in range(reps):
            engine.judge(running.at(now), cfg)
        middle = perf()
        for _ in range(reps):
            engine.evaluate(history, cfg)
        end = perf()
        result = {
            "history_s": history_s,
            "running_us": (middle - start) / reps * 1e6,
            "windowed_us": (end - middle) / reps * 1e6,
        }
        results.append(result)
        label = f"rules per GPU, {_history(history_s)}: running state / windowed reference"
        rows.append(Row(label, f"{result['running_us']:.0f} / {result['windowed_us']:.0f}", "µs"))
    return results


def _history(seconds: float) -> str:
    if not seconds:
        return "no history"
    return f"{seconds / 3600:g} h of history" if seconds >= 3600 else f"{seconds / 60:g} min of history"


class _TickRig:
    """A Monitor with SQLite and status.json, as in the daemon, its rules' history filled; `tick()` times one tick.

    With `history_s` None, at the rules' steady history: the longest window plus two intervals. The
    runtime dir is on tmpfs where there is one, as /run/gpuwatch is on a node: on a disk, replacing
    status.json every tick can cost milliseconds of the filesystem's own (ext4 flushes a file renamed
    over another), which would hide the daemon's cost.
    """

    def __init__(self, ctx: Context, interval_s: float, history_s: float | None = None) -> None:
        self.ctx, self.interval_s, self.history_s = ctx, interval_s, history_s
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _TickRig:
        ctx, interval_s = self.ctx, self.interval_s
        root = ctx.workdir / f"tick-{interval_s:g}s-{ctx.gpus}-{self.history_s}"
        tmpfs = Path("/dev/shm")
        run_root = self._stack.enter_context(
            tempfile.TemporaryDirectory(prefix="gpuwatch-bench-", dir=tmpfs if tmpfs.is_dir() else root)
        )
        self.clock = ManualClock(time.time())
        config = dataclasses.replace(
            bench_config(ctx, interval_s), state_dir=str(root / "state"), runtime_dir=str(Path(run_root) / "run")
        )
        backend, statics = open_backend(ctx, config, self.clock)
        self._stack.callback(backend.close)
        runtime = RuntimeDir(config.runtime_dir)
        runtime.prepare()
        self._stack.callback(runtime.close)
        store = Store(config.db_path)
        self._stack.callback(store.close)
        self.gpus = len(statics)
        self.monitor = Monitor(backend, statics, config, store=store, runtime=runtime, clock=self.clock)
        if self.history_s is None:
            self.history_s = engine.max_window_s(self.monitor.rules) + 2 * interval_s
        steps = math.ceil(self.history_s / interval_s)
        _fill_history(self.monitor, backend, statics, self.clock, interval_s, steps)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def tick(self) -> float:
        """One tick an interval after the last, in seconds."""
        self.clock.t += self.interval_s
        start = time.perf_counter()
        self.monitor.tick()
        return time.perf_counter() - start

    def history_bytes_per_gpu(self) -> float:
        history_bytes = self.monitor.history_bytes()
        return sum(history_bytes.values()) / len(history_bytes)


def _tick_cost(ctx: Context, interval_s: float, ticks: int) -> dict[str, Any]:
    """Monitor.tick at the rules' steady history, and the /metrics render after it."""
    with _TickRig(ctx, interval_s) as rig:
        monitor = rig.monitor
        renderer = MetricsRenderer(SnapshotCollector(lambda: monitor.snapshot), key=lambda: id(monitor.snapshot))
        tick_s: list[float] = []
        render_s: list[float] = []
        for _ in range(WARM_UP_TICKS):  # the first ones create status.json and the SQLite rows
            rig.tick()
        for _ in range(ticks):
            tick_s.append(rig.tick())
            start = time.perf_counter()
            renderer.render()
            render_s.append(time.perf_counter() - start)
        history_bytes = rig.history_bytes_per_gpu()
        history_s, gpus = rig.history_s, rig.gpus
    stats = summarize(tick_s, "ms")
    return {
        "interval_s": interval_s,
        "history_s": history_s,
        "tick_ms": stats,
        "tick_per_gpu_us": stats["mean_ms"] * 1e3 / gpus,
        "tick_p50_per_gpu_us": stats["p50_ms"] * 1e3 / gpus,
        "history_bytes_per_gpu": history_bytes,
        "render_ms": summarize(render_s, "ms"),
        "cpu_s_per_hour": stats["mean_ms"] / 1e3 * 3600 / interval_s,
        "core_pct": stats["mean_ms"] / 1e3 / interval_s * 100,
    }


def _fill_history(
    monitor: Monitor, backend: Backend, statics: list[GpuStatic], clock: ManualClock, interval_s: float, steps: int
) -> None:
    """Fold `steps` rounds of one real round's readings, re-stamped, into the rules' state without judging.

    The cost of a tick depends on how much state the rules keep, not on the readings' values, and
    judging each of the thousands of warm-up rounds would only slow the bench down.
    """
    readings: list[GpuSample] = [backend.sample(s.index, clock()) for s in statics]
    for _ in range(steps):
        clock.t += interval_s
        monitor.preload(dataclasses.replace(r, t=clock.t) for r in readings)
