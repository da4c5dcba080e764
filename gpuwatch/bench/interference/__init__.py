"""Interference: what a monitor costs the training job beside it (`gpuwatch bench --only interference`).

section.py runs it (the job alone and beside each monitor, interleaved, then the attribution by NVML
call and daemon thread); job.py and caller.py are the processes it drives (child.py their line
protocol), beside.py the monitors, plan.py the order, cpus.py where each runs; the ratios and
intervals are the bench's statistics (bench/stats.py). The section is loaded when it runs:
`gpuwatch run --backend gpuwatch.bench.interference.variants:…` imports only variants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatch.bench.harness import Context
    from gpuwatch.bench.report import Section

# What may run beside the job (--interference-conditions), by key, and the default set: gpuwatch as
# shipped, gpuwatch with the NVML event set it registered before nvml.events, and its nearest peer.
CONDITIONS = {
    "gpuwatch_1s": "gpuwatch @ 1 s",
    "gpuwatch_1s_event_set": "gpuwatch @ 1 s, NVML event set (nvml.events = all)",
    "gpuwatch_30s": "gpuwatch @ 30 s",
    "nvitop_exporter_1s": "nvitop-exporter @ 1 s",
    "nvidia_smi_1s": "nvidia-smi --query-gpu @ 1 s",
}
DEFAULT_CONDITIONS = ("gpuwatch_1s", "gpuwatch_1s_event_set", "nvitop_exporter_1s")
STEPS = ("short", "long")  # the job's step kinds (--interference-steps), in the order they run
DEFAULT_STEPS = ("short",)


def run(ctx: Context) -> Section:
    from gpuwatch.bench.interference.section import run as run_section

    return run_section(ctx)
