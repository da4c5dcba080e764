"""Footprint: the daemon's CPU seconds per hour and RSS after a measured period, at 1 s and 30 s intervals.

All processes run at once over the same period (so the period is paid once): gpuwatch at 1 s, gpuwatch
at 30 s, and nvitop-exporter at 1 s where it is installed. CPU is counted from when each answers
its first request, so start-up imports are left out; each is scraped every 15 s as Prometheus would.
The rules' state stops growing once their sample windows are full (two minutes; health/running.py), so
the period need not cover the hour-long ECC window.

Where the RSS goes: each import set below is loaded alone in a fresh interpreter and its RSS read, so
the table shows the floor the mission's packages set (FastAPI, uvicorn, APScheduler, prometheus-client,
and pynvml for NVML) before gpuwatch holds a single sample.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from typing import Any

import psutil

from gpuwatch.bench.daemon_process import ServerProcess, child_env
from gpuwatch.bench.harness import Context, Http, bench_daemon, nvitop_exporter, progress
from gpuwatch.bench.report import REFERENCE, REFERENCE_SOURCE, Row, Section, target

SCRAPE_EVERY_S = 15.0
CPU_SHARE_OF_NVITOP = 0.5
# label → the modules imported, alone in a fresh interpreter
IMPORT_SETS: dict[str, tuple[str, ...]] = {
    "python alone": (),
    "prometheus_client": ("prometheus_client",),
    "pynvml": ("pynvml",),
    "apscheduler": ("apscheduler.schedulers.background",),
    "uvicorn": ("uvicorn",),
    "fastapi (with pydantic, starlette)": ("fastapi",),
    "mission packages together": (
        "prometheus_client",
        "pynvml",
        "apscheduler.schedulers.background",
        "uvicorn",
        "fastapi",
    ),
    "mission packages but fastapi": ("prometheus_client", "pynvml", "apscheduler.schedulers.background", "uvicorn"),
    "gpuwatch run's imports": ("gpuwatch.cli", "gpuwatch.daemon"),
}
_RSS_PROBE = (
    "import sys\n"
    "for name in sys.argv[1:]: __import__(name)\n"
    "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:')))"
)


def run(ctx: Context) -> Section:
    period = ctx.footprint_s
    section = Section("footprint")
    services: dict[str, ServerProcess] = {
        "gpuwatch_1s": bench_daemon(ctx, "footprint-1s", interval_s=1.0),
        "gpuwatch_30s": bench_daemon(ctx, "footprint-30s", interval_s=30.0),
    }
    peer = nvitop_exporter(ctx, "footprint")
    peer_status = "not installed" if peer is None else "ok"
    with contextlib.ExitStack() as stack:
        for service in services.values():
            stack.enter_context(service)
        if peer is not None:
            try:
                stack.enter_context(peer)
                services["nvitop_exporter_1s"] = peer
            except RuntimeError as exc:
                peer_status = f"failed to start: {exc}"
        progress(f"footprint: {', '.join(services)} for {period:g} s")
        figures = _measure(services, period)
    figures["nvitop_exporter_1s"] = figures.get("nvitop_exporter_1s", {"status": peer_status})
    section.figures = {"period_s": period, "scrape_every_s": SCRAPE_EVERY_S, **figures}
    _rows(section, figures, peer_status == "ok")
    section.figures["import_rss_mb"] = imports = import_rss()
    for label, rss in imports.items():
        section.rows.append(Row(f"RSS after importing {label}", rss, "MiB"))
    return section


def import_rss() -> dict[str, float | None]:
    """RSS (MiB) of a fresh interpreter after importing each set of IMPORT_SETS; None where one fails."""
    result: dict[str, float | None] = {}
    for label, modules in IMPORT_SETS.items():
        probe = subprocess.run(
            [sys.executable, "-c", _RSS_PROBE, *modules],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=child_env(),
        )
        result[label] = int(probe.stdout.strip()) / 1024 if probe.returncode == 0 else None
    return result


def _measure(services: dict[str, ServerProcess], period: float) -> dict[str, Any]:
    processes = {name: psutil.Process(service.pid) for name, service in services.items()}
    clients = {name: Http(service.port) for name, service in services.items()}
    start_cpu = {name: _cpu(p) for name, p in processes.items()}
    started = time.monotonic()
    next_scrape = next_progress = started
    try:
        while (now := time.monotonic()) < started + period:
            if now >= next_scrape:
                for client in clients.values():
                    client.request("GET", "/metrics")
                next_scrape += SCRAPE_EVERY_S
            if now >= next_progress + 30:
                next_progress = now
                progress(f"footprint: {now - started:.0f}/{period:g} s")
            time.sleep(min(0.5, max(0.0, started + period - now)))
        elapsed = time.monotonic() - started
        figures: dict[str, Any] = {}
        for name, proc in processes.items():
            cpu_s = _cpu(proc) - start_cpu[name]
            figures[name] = {
                "status": "ok",
                "cpu_s": cpu_s,
                "cpu_s_per_hour": cpu_s / elapsed * 3600,
                "core_pct": cpu_s / elapsed * 100,
                "rss_mb": proc.memory_info().rss / 2**20,
            }
    finally:
        for client in clients.values():
            client.close()
    return figures


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _rows(section: Section, figures: dict[str, Any], measured_peer: bool) -> None:
    fast, slow, peer = figures["gpuwatch_1s"], figures["gpuwatch_30s"], figures["nvitop_exporter_1s"]
    if measured_peer:
        cpu_limit, rss_limit, against = peer["core_pct"] * CPU_SHARE_OF_NVITOP, peer["rss_mb"], "measured"
    else:
        cpu_limit = REFERENCE["nvitop_cpu_core_pct"] * CPU_SHARE_OF_NVITOP
        rss_limit, against = REFERENCE["nvitop_rss_mb"], REFERENCE_SOURCE
    rows = section.rows
    rows.append(target("gpuwatch CPU @ 1 s", fast["core_pct"], "% core", cpu_limit, against=against))
    rows.append(Row("gpuwatch CPU @ 1 s", fast["cpu_s_per_hour"], "CPU-s/h"))
    rows.append(target("gpuwatch RSS @ 1 s", fast["rss_mb"], "MiB", rss_limit, against=against))
    rows.append(Row("gpuwatch CPU @ 30 s", slow["core_pct"], "% core"))
    rows.append(Row("gpuwatch CPU @ 30 s", slow["cpu_s_per_hour"], "CPU-s/h"))
    rows.append(Row("gpuwatch RSS @ 30 s", slow["rss_mb"], "MiB"))
    if measured_peer:
        rows.append(Row("nvitop-exporter CPU @ 1 s", peer["core_pct"], "% core"))
        rows.append(Row("nvitop-exporter RSS @ 1 s", peer["rss_mb"], "MiB"))
    else:
        rows.append(Row("nvitop-exporter", peer["status"]))
