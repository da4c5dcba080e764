"""The bench's daemons and peers, on the test harness's processes (gpuwatch.testing.daemon_process).

`bench_daemon` is a daemon on the bench's backend that never quarantines (a quarantine signals the
processes on that GPU, and on a real node those are someone's job); `nvitop_exporter` is the peer it
is compared with.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from gpuwatch.bench.harness import Context
from gpuwatch.testing.daemon_process import ConfigTables, DaemonProcess, ServerProcess, free_port


def bench_daemon(ctx: Context, name: str, interval_s: float, tables: ConfigTables | None = None) -> DaemonProcess:
    """`gpuwatch run` on the bench's backend, at `interval_s`, with `tables` over the bench's config (no quarantine).

    A start that fails says so in one line (the last of its log), as a section's reason in the table.
    """
    merged: dict[str, dict[str, Any]] = {"policy": {"quarantine_on_unhealthy": False}}
    for section, values in (tables or {}).items():
        merged.setdefault(section, {}).update(values)
    args = ["--interval", f"{interval_s:g}", "--log-level", "warning"]
    if ctx.backend == "sim":
        args += ["--sim-gpus", str(ctx.gpus), "--sim-scenario", "healthy", "--seed", "0"]
    root = ctx.workdir / name
    return DaemonProcess(root, *args, backend=ctx.backend, config=merged, name=f"gpuwatch run ({name})", tail_lines=1)


def nvitop_exporter(ctx: Context, name: str, interval_s: float = 1.0) -> ServerProcess | None:
    """nvitop-exporter as its own process (`python -m nvitop_exporter`) on a free port; None when not installed."""
    if importlib.util.find_spec("nvitop_exporter") is None:
        return None
    port = free_port()
    args = [sys.executable, "-m", "nvitop_exporter", "--bind-address", "127.0.0.1", "--port", str(port)]
    args += ["--interval", f"{interval_s:g}"]
    return ServerProcess(f"nvitop-exporter ({name})", args, port, ctx.workdir / f"nvitop-{name}.log", tail_lines=1)
