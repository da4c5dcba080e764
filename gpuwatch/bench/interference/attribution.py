"""Attribution: which of the daemon's NVML calls, and which of its threads, cost the job.

Per call: the helper process (caller.py) makes one kind of call at `rate` a second during that
kind's segment, each between two alone segments (one round: the per-kind figure is one pair, so the
run also reports the noise of a pair, from the alone segments compared the same way). The job's
slowdown divided by the calls made is the job time one call costs; times the calls a second the
daemon makes at a 1 s interval per GPU (read plan before and now) it is that call's share of the
daemon's cost. Per thread: the real daemon at 1 s, scraped every second, with one part of its NVML
work left out (variants.py), the sim backend (everything but NVML), and the sim daemon scraped 100
times a second (serving, amplified).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from typing import Any

from gpuwatch.backends import nvml_plan
from gpuwatch.bench import stats
from gpuwatch.bench.daemons import bench_daemon
from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.interference import variants
from gpuwatch.bench.interference.beside import Beside, CallLoop, Monitor
from gpuwatch.bench.interference.caller import NVML_KINDS, SIM_KINDS, CallerProcess, Kind
from gpuwatch.bench.interference.plan import interleave
from gpuwatch.bench.interference.runner import Job, summarize, time_segments
from gpuwatch.bench.report import Row, Section

SERVING_SCRAPES_PER_S = 100.0


def run(
    ctx: Context, job: Job, *, attribute_s: float, daemon_s: float, rate: float, settle_s: float, restart: bool
) -> dict[str, Any]:
    """Time the job (already on its short step) beside each call kind and each daemon variant; the figures."""
    kinds = {kind.name: kind for kind in (NVML_KINDS if ctx.backend == "nvml" else SIM_KINDS)}
    caller = CallerProcess(ctx.backend, 0, ctx.gpus, ctx.workdir / "caller.stderr")
    loops: list[CallLoop] = []
    daemons: list[Beside] = []
    skipped: dict[str, str] = {}
    try:
        for name, kind in kinds.items():
            why = caller.probe(name)
            if why:
                skipped[name] = why
            else:
                loops.append(CallLoop(caller, name, kind.what, rate))
        for daemon in _daemons(ctx, functools.partial(Monitor, settle_s=settle_s, restart=restart)):
            try:
                daemon.open()
            except RuntimeError as exc:
                skipped[daemon.key] = str(exc)
                continue
            daemons.append(daemon)
        besides: list[Beside] = [*loops, *daemons]
        segments = interleave([b.key for b in besides], 1, attribute_s, {d.key: daemon_s for d in daemons})
        total = sum(s.seconds for s in segments)
        progress(
            f"interference: attribution, {len(loops)} call kinds at {rate:g}/s, {len(daemons)} daemons, ~{total:.0f} s"
        )
        timed = time_segments(job, segments, {b.key: b for b in besides}, "attribution")
    finally:
        closed = {d.key: d.close() for d in daemons}
        caller.close()
    labels = {b.key: b.label for b in besides}
    summary = summarize(timed, labels)
    noise = _noise_pct(timed)
    skipped.update({loop.kind: loop.failed for loop in loops if loop.failed})
    calls = {loop.kind: _call(kinds[loop.kind], loop, summary[loop.key], noise) for loop in loops if not loop.failed}
    return {
        "segment_s": attribute_s,
        "daemon_segment_s": daemon_s,
        "rate_per_s": rate,
        "pair_noise_pct": noise,
        "calls": calls,
        "daemons": {d.key: {**_daemon(summary[d.key], d.key), **closed[d.key]} for d in daemons},
        "skipped": skipped,
        "projected_sum_pct": _sums(calls),
    }


def _daemons(ctx: Context, monitor: Callable[..., Monitor]) -> list[Beside]:
    """The daemon at 1 s with one part of its NVML work left out; and with none (sim), scraped at 1 and 100/s."""
    found: list[Beside] = []
    if ctx.backend == "nvml":
        for key, label, cls in (
            ("daemon:now", "gpuwatch @ 1 s, read plan now", None),
            ("daemon:before", "gpuwatch @ 1 s, read plan before", variants.NvmlBeforePlan),
            ("daemon:no_events", "gpuwatch @ 1 s, no event-thread NVML", variants.NvmlWithoutEvents),
            ("daemon:events_only", "gpuwatch @ 1 s, event-thread NVML only", variants.NvmlEventsOnly),
        ):
            variant = ctx if cls is None else dataclasses.replace(ctx, backend=variants.backend_name(cls))
            found.append(monitor(key, label, bench_daemon(variant, f"attr-{key[7:]}", 1.0), 1.0))
    sim = dataclasses.replace(ctx, backend="sim")
    no_nvml = "gpuwatch --backend sim @ 1 s (no NVML)"
    found.append(monitor("daemon:no_nvml", no_nvml, bench_daemon(sim, "attr-no-nvml", 1.0), 1.0))
    serving = f"gpuwatch --backend sim @ 1 s, scraped {SERVING_SCRAPES_PER_S:g}/s"
    daemon = bench_daemon(sim, "attr-serving", 1.0)
    found.append(monitor("daemon:serving", serving, daemon, 1.0 / SERVING_SCRAPES_PER_S))
    return found


def _noise_pct(timed: list[tuple[str, list[float]]]) -> float | None:
    """One standard deviation of an alone segment's mean against its alone neighbours, in percent."""
    segments = [(key, stats.summarize_steps(steps)) for key, steps in timed]
    placebo = stats.paired_ratios(segments, "mean").get(stats.ALONE, [])
    return statistics.stdev(placebo) * 100 if len(placebo) >= 2 else None


def _call(kind: Kind, loop: CallLoop, entry: dict[str, Any], noise: float | None) -> dict[str, Any]:
    """One kind's slowdown, its cost per call, and its share of the daemon's cost at 1 s (plan before and now)."""
    cost = entry["mean_vs_alone"]["pct"]
    made = loop.close()
    per_s = made["calls_per_s"] or 0.0
    result: dict[str, Any] = {"what": kind.what, **made, "mean_pct": cost, "p50_pct": entry["p50_vs_alone"]["pct"]}
    if kind.per_s is None:  # at its own pace: the slowdown is the daemon's
        result.update(scaled=False, projected_now_pct=cost, projected_before_pct=cost, noise_projected_pct=noise)
        return result

    def per_call_us(pct: float | None) -> float | None:
        return None if pct is None or not per_s else pct / 100 / per_s * 1e6

    result.update(scaled=True, job_us_per_call=per_call_us(cost), noise_us_per_call=per_call_us(noise))
    for plan_name, plan in (("now", nvml_plan.DEFAULT), ("before", nvml_plan.BEFORE)):
        daemon_per_s = kind.per_s(plan)
        result[f"daemon_per_s_{plan_name}"] = daemon_per_s
        result[f"projected_{plan_name}_pct"] = cost * daemon_per_s / per_s if per_s else None
        noise_pct = None if noise is None or not per_s else noise * daemon_per_s / per_s
        result[f"noise_projected_{plan_name}_pct"] = noise_pct
    return result


def _daemon(entry: dict[str, Any], key: str) -> dict[str, Any]:
    result = {
        "label": entry["label"],
        "mean_pct": entry["mean_vs_alone"]["pct"],
        "p50_pct": entry["p50_vs_alone"]["pct"],
    }
    if key == "daemon:serving":  # per scrape, and at one scrape a second
        result["projected_1_per_s_pct"] = result["mean_pct"] / SERVING_SCRAPES_PER_S
    return result


def _sums(calls: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The per-call projections of the calls a daemon makes, added up (alternatives and whole samples excluded)."""
    made = {name: c for name, c in calls.items() if c["scaled"] and not name.startswith("sample_")}
    return {
        plan: sum(c[f"projected_{plan}_pct"] or 0.0 for c in made.values() if c[f"daemon_per_s_{plan}"])
        for plan in ("now", "before")
    }


def rows(section: Section, figures: dict[str, Any] | None) -> None:
    """The attribution's part of the table: the largest projected costs first."""
    if figures is None:
        section.notes.append("attribution not run (--attribute-s 0)")
        return
    noise = figures["pair_noise_pct"]
    section.rows.append(Row("attribution: one pair's noise (alone vs alone), 1 σ", noise, "%"))
    ordered = sorted(figures["calls"].items(), key=lambda item: -(item[1]["projected_before_pct"] or 0.0))
    for name, call in ordered:
        detail = f"slowdown {call['mean_pct']:+.3f} % at {call['calls_per_s'] or 0:.0f}/s"
        if call.get("job_us_per_call") is not None:
            detail += f", {call['job_us_per_call']:.3g} µs a call (noise {call['noise_us_per_call'] or 0:.2g})"
        value = f"{_pct(call['projected_now_pct'])} / {_pct(call['projected_before_pct'])}"
        section.rows.append(Row(f"call {name}: cost at 1 s, plan now / before", value, f"% ({detail})"))
    sums = figures["projected_sum_pct"]
    value = f"{_pct(sums['now'])} / {_pct(sums['before'])}"
    section.rows.append(Row("the daemon's calls summed: cost at 1 s, plan now / before", value, "%"))
    for daemon in figures["daemons"].values():
        value = f"{daemon['mean_pct']:+.3f} / {daemon['p50_pct']:+.3f}"
        section.rows.append(Row(f"thread split · {daemon['label']}: mean / p50 vs alone", value, "%"))
    for name, why in figures["skipped"].items():
        section.notes.append(f"attribution: {name} not measured: {why}")
    section.notes.append(
        "attribution: cost at 1 s = slowdown beside the helper × the daemon's calls a second (per GPU, at a 1 s "
        "interval) ÷ the helper's; one pair per kind: compare a call's µs with its noise in µs"
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"
