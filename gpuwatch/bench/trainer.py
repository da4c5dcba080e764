"""TrainerLink.step(): what gpuwatch costs a training loop per step (the issue's target: ≤ 50 µs)."""

from __future__ import annotations

import statistics

from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.report import Section, target
from gpuwatch.trainer.link import bench_step

STEP_TARGET_US = 50.0


def run(ctx: Context) -> Section:
    calls, repeats = int(ctx.pick(200_000, 20_000)), int(ctx.pick(5, 3))
    progress(f"trainer: TrainerLink.step() × {calls} × {repeats}")
    per_call_us = [bench_step(calls) * 1e6 for _ in range(repeats)]
    median = statistics.median(per_call_us)
    section = Section("trainer")
    section.figures = {"calls": calls, "repeats": repeats, "step_us": {"median": median, "min": min(per_call_us)}}
    section.rows.append(target("TrainerLink.step() per call, median", median, "µs", STEP_TARGET_US))
    return section
