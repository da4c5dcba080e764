"""Interference: what a monitor costs the training job beside it, in the job's own step time.

A job process (job.py) steps without end on a CPU of its own (cpus.py): a short step (8 bf16 4096³
matmuls and a synchronize, ~1.7 ms on an H200) and, when asked, a long one (~50 ms). First the
event-set probe: a helper process (caller.py) registers an idle NVML event set for some segments and
none for the others. Then the monitors (by default gpuwatch at 1 s as shipped, gpuwatch at 1 s with
the NVML event set it registered before `nvml.events`, nvitop-exporter at 1 s), each started around
its own segments and scraped every second (beside.py). Both are interleaved with alone segments in
rounds (plan.py); each segment is compared with the alone segments either side of it, with a Student t
interval over the rounds, and two conditions with each other round by round (bench/stats.py). The job is
also timed before anything starts and after everything stops (bare). The attribution by NVML call and
daemon thread (attribution.py) runs last when asked for (--attribute-s).

With `--backend sim` the job is a CPU step loop beside the sim daemon: it tests the method and the
CPU side; the GPU side is not measured. docs/performance-interference.md says how to read the table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from gpuwatch.bench import sampling
from gpuwatch.bench.daemons import bench_daemon, nvitop_exporter
from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.interference import CONDITIONS, DEFAULT_CONDITIONS, DEFAULT_STEPS, attribution, cpus, rows
from gpuwatch.bench.interference.beside import (
    START_SETTLE_S,
    THAW_SETTLE_S,
    Beside,
    CallLoop,
    CommandLoop,
    Monitor,
    kernel_log_facts,
)
from gpuwatch.bench.interference.caller import CallerProcess
from gpuwatch.bench.interference.job import JobProcess
from gpuwatch.bench.interference.plan import interleave, rounds_within
from gpuwatch.bench.interference.runner import differences, planned_round_s, summarize, time_segments
from gpuwatch.bench.report import Section, Skip
from gpuwatch.bench.serving import NVIDIA_SMI_FIELDS
from gpuwatch.bench.stats import ALONE, pooled

SHARE = {"short": 0.6, "long": 0.4}  # of the monitors' rounds when both steps run: the short step shows the cost most
OURS, OURS_EVENT_SET, OURS_30S, NVITOP = "gpuwatch_1s", "gpuwatch_1s_event_set", "gpuwatch_30s", "nvitop_exporter_1s"
EVENT_SET = "event_set_idle"  # the probe's kind: what gpuwatch registered before nvml.events (XID, ECC)
# Compared round by round: (condition, minus this one, label).
DIFFERENCES = (
    (OURS_EVENT_SET, OURS, "gpuwatch @ 1 s with the NVML event set minus without"),
    (OURS, NVITOP, "gpuwatch @ 1 s minus nvitop-exporter @ 1 s"),
)
CI_METHOD = "ratio to the alone segments either side, per pair; 95 % Student t interval over the pairs"


@dataclass(frozen=True)
class Settings:
    """Durations and rates of one run (the command's flags over the mode's defaults)."""

    budget_s: float  # the monitors' interleaved rounds, every step kind together (each gets at least 2 rounds)
    segment_s: float  # one timed segment of the monitors' rounds
    conditions: tuple[str, ...]
    steps: tuple[str, ...]
    restart: bool  # monitors started and stopped around their segments, not frozen between them
    event_set_s: float  # the event-set probe's rounds (0: no probe)
    event_set_segment_s: float
    first_warm_up_s: float  # the card from idle to its steady clocks under the job's load
    warm_up_s: float  # after a switch of step
    settle_s: float  # after a monitor is started (or thawed), before the job is timed
    probe_settle_s: float  # after the helper registered its event set
    attribute_s: float  # each call kind's segment (0: no attribution)
    daemon_s: float  # each daemon variant's segment in the attribution
    rate: float  # the attribution helper's calls a second
    scrape_s: float = 1.0

    @classmethod
    def of(cls, ctx: Context) -> Settings:
        flags = ctx.interference

        def given(value: float | None, full: float, quick: float) -> float:
            return value if value is not None else ctx.pick(full, quick)

        attribute_s = given(flags.attribute_s, 0.0, 0.0)
        return cls(
            budget_s=given(flags.rounds_s, 120.0, 0.0),
            segment_s=given(flags.segment_s, 3.0, 0.4),
            conditions=flags.conditions or DEFAULT_CONDITIONS,
            steps=flags.steps or DEFAULT_STEPS,
            restart=flags.restart,
            event_set_s=given(flags.event_set_s, 50.0, 0.0),
            event_set_segment_s=ctx.pick(2.0, 0.3),
            first_warm_up_s=ctx.pick(10.0, 0.3),
            warm_up_s=ctx.pick(3.0, 0.3),
            settle_s=ctx.pick(START_SETTLE_S if flags.restart else THAW_SETTLE_S, 0.3),
            probe_settle_s=ctx.pick(0.2, 0.1),
            attribute_s=attribute_s,
            daemon_s=2 * attribute_s,
            rate=flags.attribute_rate or ctx.pick(1000.0, 200.0),
        )


def run(ctx: Context) -> Section:
    if importlib.util.find_spec("torch") is None:
        raise Skip("torch is not installed: the job's step loop needs it")
    settings = Settings.of(ctx)
    gpu = _first_gpu(ctx)
    on_gpu = ctx.backend == "nvml"
    placement = cpus.place(gpu.pci_bus_id if on_gpu else "")
    section = Section("interference")
    notes = section.notes
    if not on_gpu:
        notes.append(
            "sim backend: the job is a CPU step loop (float32 256³ matmuls, one thread) beside the sim daemon; "
            "the GPU side was not measured"
        )
    notes.append(f"placement: {placement.why} ({_placement_text(placement)})")
    how = "started for each of its segments and killed after it" if settings.restart else "frozen between segments"
    notes.append(f"interval: {CI_METHOD}; 'alone' rows compare alone with alone (the placebo); monitors {how}")
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": gpu.uuid} if on_gpu else {}
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, placement.others)  # the monitors and helpers started from here inherit it
    try:
        with JobProcess("cuda" if on_gpu else "cpu", placement.job, ctx.workdir, env) as job:
            figures = _measure(ctx, settings, job, notes)
    finally:
        os.sched_setaffinity(0, previous)
    section.figures = {
        "device": "cuda" if on_gpu else "cpu",
        "gpu_measured": on_gpu,
        "gpu": {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid},
        "placement": placement.as_dict(),
        "interval_method": CI_METHOD,
        "settings": dataclasses.asdict(settings),
        **figures,
    }
    rows.add(section, on_gpu)
    if settings.attribute_s > 0 and "attribution_error" not in figures:
        attribution.rows(section, section.figures.get("attribution"))
    return section


def _first_gpu(ctx: Context) -> Any:
    backend, statics = sampling.open_backend(ctx, sampling.bench_config(ctx))
    backend.close()
    return statics[0]


def _placement_text(placement: cpus.Placement) -> str:
    if placement.job is None:
        return "not pinned"
    idle = f", idle {cpus.cpu_list(placement.idle)}" if placement.idle else ""
    return f"job CPU {placement.job}{idle}, monitors {cpus.cpu_list(placement.others)}"


def _monitors(ctx: Context, settings: Settings, notes: list[str]) -> list[Beside]:
    """The conditions asked for that can run here, in their order; each one left out says why in the notes."""
    monitor = functools.partial(
        Monitor, scrape_s=settings.scrape_s, settle_s=settings.settle_s, restart=settings.restart
    )
    on_gpu = ctx.backend == "nvml"
    found: list[Beside] = []
    for key in settings.conditions:
        label = CONDITIONS[key]
        if key == OURS:
            facts = kernel_log_facts if on_gpu else None  # the sim daemon has no kernel log
            found.append(monitor(key, label, bench_daemon(ctx, "interference-1s", 1.0), facts=facts))
        elif key == OURS_30S:
            found.append(monitor(key, label, bench_daemon(ctx, "interference-30s", 30.0)))
        elif not on_gpu:
            notes.append(f"{label}: not measured on the sim backend (it needs NVML or a GPU)")
        elif key == OURS_EVENT_SET:
            daemon = bench_daemon(ctx, "interference-1s-event-set", 1.0, {"nvml": {"events": "all"}})
            found.append(monitor(key, label, daemon, facts=kernel_log_facts))
        elif key == NVITOP:
            exporter = nvitop_exporter(ctx, "interference", 1.0)
            if exporter is None:
                notes.append(f"{label}: not installed, not measured (pip install nvitop-exporter)")
            else:
                found.append(monitor(key, label, exporter))
        elif (smi := shutil.which("nvidia-smi")) is None:
            notes.append(f"{label}: nvidia-smi is not on PATH, not measured")
        else:
            argv = [smi, f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader"]
            found.append(CommandLoop(key, label, argv, 1.0))
    if settings.restart and OURS_30S in settings.conditions:
        notes.append(f"{CONDITIONS[OURS_30S]}: started for each segment, it samples before it: its row is its presence")
    return found


def _measure(ctx: Context, settings: Settings, job: JobProcess, notes: list[str]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    seconds = settings.segment_s
    step_s = {"short": job.use("short", settings.first_warm_up_s)}
    bare = [_time_alone(job, seconds)]  # before anything else has started
    if settings.event_set_s > 0:
        figures["event_set"] = _event_set_probe(ctx, settings, job, notes)
    besides = _open(_monitors(ctx, settings, notes), notes)
    _say_how_long(settings, besides)
    current = "short"
    try:
        for kind in settings.steps:
            if kind not in step_s:
                step_s[kind] = job.use(kind, settings.warm_up_s)
            current = kind
            share = SHARE[kind] / sum(SHARE[k] for k in settings.steps)
            rounds = rounds_within(settings.budget_s * share, planned_round_s(besides, seconds))
            segments = interleave([b.key for b in besides], rounds, seconds)
            progress(f"interference: {kind} step ({step_s[kind] * 1e3:.3g} ms), {rounds} rounds of {seconds:g} s")
            timed = time_segments(job, segments, {b.key: b for b in besides}, f"{kind} step")
            figures[kind] = {
                "step_ms": step_s[kind] * 1e3,
                "rounds": rounds,
                "segment_s": seconds,
                "conditions": summarize(timed, {b.key: b.label for b in besides}),
                "differences": differences(timed, DIFFERENCES),
            }
    finally:
        figures["monitors"] = {b.key: b.close() for b in besides}
    _kernel_log_notes(figures["monitors"], notes)
    if current != "short":
        job.use("short", settings.warm_up_s)
    bare.append(_time_alone(job, seconds))  # after everything has stopped
    alone = figures.get("short", {}).get("conditions", {}).get(ALONE)
    figures["bare"] = _bare(bare, alone)
    if settings.attribute_s <= 0:
        return figures
    try:
        figures["attribution"] = attribution.run(
            ctx,
            job,
            attribute_s=settings.attribute_s,
            daemon_s=settings.daemon_s,
            rate=settings.rate,
            settle_s=settings.settle_s,
            restart=settings.restart,
        )
    except (RuntimeError, OSError, ValueError) as exc:  # the rounds' figures stand without it
        figures["attribution_error"] = f"{type(exc).__name__}: {exc}"
        notes.append(f"attribution failed: {figures['attribution_error']}")
    return figures


def _event_set_probe(ctx: Context, settings: Settings, job: JobProcess, notes: list[str]) -> dict[str, Any] | None:
    """The job (short step) with a helper holding an idle NVML event set, against the helper holding none.

    The helper has NVML open in every segment, so the two differ by the registered set only. Switching
    costs milliseconds, not a start-up, so many short pairs fit where a monitor's rounds fit few.
    """
    if ctx.backend != "nvml":
        notes.append("event-set probe: needs NVML (the nvml backend), not run")
        return None
    caller = CallerProcess(ctx.backend, 0, ctx.gpus, ctx.workdir / "probe.stderr")
    try:
        why = caller.probe(EVENT_SET)
        if why:
            notes.append(f"event-set probe: not run: {why}")
            return None
        label = "idle NVML event set (XID, ECC) held by a helper"
        loop = CallLoop(caller, EVENT_SET, label, 1.0, settle_s=settings.probe_settle_s)
        seconds = settings.event_set_segment_s
        rounds = rounds_within(settings.event_set_s, planned_round_s([loop], seconds))
        progress(f"interference: event-set probe, {rounds} pairs of {seconds:g} s")
        timed = time_segments(job, interleave([loop.key], rounds, seconds), {loop.key: loop}, "event-set probe")
    finally:
        caller.close()
    if loop.failed:
        notes.append(f"event-set probe: the helper could not hold its set: {loop.failed}")
        return None
    return {"key": loop.key, "segment_s": seconds, "rounds": rounds, "conditions": summarize(timed, {loop.key: label})}


def _open(besides: list[Beside], notes: list[str]) -> list[Beside]:
    """Start each monitor once (then stopped or frozen until its turn); one that does not start is left out."""
    opened = []
    for beside in besides:
        try:
            beside.open()
        except RuntimeError as exc:
            notes.append(f"{beside.label} did not start, not measured: {exc}")
            beside.close()
            continue
        opened.append(beside)
    return opened


def _kernel_log_notes(monitors: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """What nvml.events = auto did in this run's gpuwatch @ 1 s: no NVML event set only where it read the kernel log."""
    readable = monitors.get(OURS, {}).get("kernel_log_readable")
    if readable is True:
        notes.append(f"{CONDITIONS[OURS]}: read the kernel log, so no NVML event set (nvml.events = auto)")
    elif readable is False:
        notes.append(
            f"{CONDITIONS[OURS]}: could not read the kernel log, so it registered XID events (nvml.events = auto); "
            "run the bench as root for the default of a node"
        )


def _time_alone(job: JobProcess, seconds: float) -> list[float]:
    job.start()
    time.sleep(seconds)
    return job.stop()


def _bare(bare: list[list[float]], alone: dict[str, Any] | None) -> dict[str, Any]:
    """The job with no monitor process at all, against the short step's alone segments (where it ran)."""
    steps = pooled([("bare", steps) for steps in bare])["bare"]
    figures: dict[str, Any] = {**steps.as_ms(), "segments": len(bare)}
    if alone is not None:
        figures["alone_vs_bare_mean_pct"] = (alone["mean_ms"] / (steps.mean * 1e3) - 1) * 100
        figures["alone_vs_bare_p50_pct"] = (alone["p50_ms"] / (steps.p50 * 1e3) - 1) * 100
    return figures


def _say_how_long(settings: Settings, besides: list[Beside]) -> None:
    total = 0.0
    for kind in settings.steps:
        share = SHARE[kind] / sum(SHARE[k] for k in settings.steps)
        round_s = planned_round_s(besides, settings.segment_s)
        total += rounds_within(settings.budget_s * share, round_s) * round_s
    then = ", then the attribution" if settings.attribute_s > 0 else ""
    progress(f"interference: {len(besides)} conditions, about {total:.0f} s of rounds{then}")
