"""Interference: what a monitor costs the training job beside it (`gpuwatch bench --only interference`).

section.py runs it (the job alone and beside each monitor, interleaved, then the attribution by NVML
call and daemon thread); job.py and caller.py are the processes it drives, beside.py the monitors,
plan.py the order, stats.py the ratios and intervals, cpus.py where each runs. The section is loaded
when it runs: `gpuwatch run --backend gpuwatch.bench.interference.variants:…` imports only variants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatch.bench.harness import Context
    from gpuwatch.bench.report import Section


def run(ctx: Context) -> Section:
    from gpuwatch.bench.interference.section import run as run_section

    return run_section(ctx)
