"""What one tick of the daemon costs on the NVML backend, counted, not timed: NVML reads and Python calls per GPU.

A tick on an H200 is the NVML sample plus the judging around it, all Python (docs/performance.md), so
its cost is how much the sample asks of NVML and how much Python runs around it. Both are
counted here, exactly, on the NVML backend against the module-shaped fake, through a Monitor with its
SQLite store and runtime dir as in the daemon: a change that adds an NVML read to every sample, or
per-tick Python work (a rescan, a formatted string nobody reads, a wrapper per call), fails here on
any machine however loaded, where a timed test could not tell 150 µs from 200. The Python count
leaves out the fake's own frames: it is what gpuwatch and the library code it calls run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

from gpuwatch.backends.nvml import NvmlBackend
from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config
from gpuwatch.node.monitor import Monitor
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.node.store import Store
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml

T0 = 1_800_000_000.0
GPUS = 2
TICKS = 21
# What NVML reads per GPU in the usual tick (no read-plan group due, the memory in use unmoved): a call,
# or a field of a field-value batch. Utilisation, memory, power, P-state, two clocks, temperature,
# clocks-event reasons and the two volatile ECC totals, one call each, and one batch of HBM temperature
# and instantaneous power: 12. Before the read plan counted the processes only when the memory in use
# moved and read the driver's recovery action (a field that cost 10 µs on the H200) every 5 s: 14.
NVML_READS_PER_TICK = 12.0
# Python calls per GPU in the usual tick of a healthy GPU: the sample's loop, the rules' constant-time
# answers, the state machine, the Snapshot and the store's check; 203 when this bar was set, 330
# before the reads were bound once per GPU and the rules answered a quiet window at once.
PYTHON_CALLS_PER_TICK = 225.0


def _healthy() -> FakeGpu:
    """An H200 under load with nothing wrong: no ECC error, no remapped row, no process listed."""
    return FakeGpu(pids=(), remapped=(0, 0, 0, 0), ecc=dict.fromkeys(FakeGpu().ecc, 0))


def _monitor(tmp_path: Path, nvml: FakeNvml) -> tuple[Monitor, ManualClock]:
    clock = ManualClock(T0)
    config = Config(
        backend="nvml", interval_s=1.0, state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run")
    )
    backend = NvmlBackend(config, nvml=nvml)
    runtime = RuntimeDir(config.runtime_dir)
    runtime.prepare()
    monitor = Monitor(backend, backend.open(), config, store=Store(config.db_path), runtime=runtime, clock=clock)
    for _ in range(10):  # past the first ticks, which read every group and write the first rows
        clock.t += 1.0
        monitor.tick()
    return monitor, clock


def _count(tmp_path: Path) -> tuple[float, float]:
    """NVML reads and Python calls per GPU in the median tick of TICKS at 1 s (most read no read-plan group)."""
    nvml = FakeNvml([_healthy() for _ in range(GPUS)])
    monitor, clock = _monitor(tmp_path, nvml)
    python = fields = 0
    batch = nvml.nvmlDeviceGetFieldValues

    def field_values(handle: Any, field_ids: list[int]) -> Any:
        nonlocal fields
        fields += len(field_ids) - 1  # the call itself is counted with the others
        return batch(handle, field_ids)

    nvml.nvmlDeviceGetFieldValues = field_values  # type: ignore[method-assign]

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal python
        if event in ("call", "c_call") and "/tests/fakes/" not in frame.f_code.co_filename:
            python += 1

    ticks: list[tuple[float, float]] = []
    for _ in range(TICKS):
        clock.t += 1.0
        nvml.calls.clear()
        python = fields = 0
        sys.setprofile(count)
        try:
            monitor.tick()
        finally:
            sys.setprofile(None)
        ticks.append(((sum(nvml.calls.values()) + fields) / GPUS, python / GPUS))
    nvml_reads = sorted(t[0] for t in ticks)[TICKS // 2]
    python_calls = sorted(t[1] for t in ticks)[TICKS // 2]
    return nvml_reads, python_calls


def test_a_tick_reads_twelve_values_from_nvml_per_gpu(tmp_path: Path) -> None:
    nvml_reads, _ = _count(tmp_path)
    assert nvml_reads <= NVML_READS_PER_TICK, f"{nvml_reads:g} NVML reads per GPU and tick"


def test_a_ticks_python_work_per_gpu_stays_within_its_budget(tmp_path: Path) -> None:
    _, python_calls = _count(tmp_path)
    assert python_calls <= PYTHON_CALLS_PER_TICK, f"{python_calls:g} Python calls per GPU and tick"
