"""Footprint: the daemon's CPU seconds per hour and RSS after a measured period, at 1 s and 30 s intervals.

All processes run at once over the same period (so the period is paid once): gpuwatch at 1 s, gpuwatch
at 30 s, and nvitop-exporter at 1 s where it is installed. CPU is counted from when each answers
its first request, so start-up imports are left out; each is scraped every 15 s as Prometheus would.
The rules' state stops growing once their sample windows are full (two minutes; health/running.py), so
the period need not cover the hour-long ECC window.

Where the RSS goes, three ways. Each import set below is loaded alone in a fresh interpreter and its
RSS read: the floor the mission's packages set (FastAPI, uvicorn, APScheduler, prometheus-client, and
pynvml for NVML) before gpuwatch holds a single sample. The import ladder loads what `gpuwatch run`
imports in one interpreter, part after part, so each step's RSS is what that part adds on top of the
ones before (the steps sum to the whole), then initialises NVML on the nvml backend; the peer's
ladder does the same with what nvitop-exporter imports, so the two floors read side by side. And the
running daemon's RSS, and the peer's, is split by what is mapped (/proc/PID/smaps): Python's objects
(anonymous memory and the heap), libpython, NVML's library, OpenSSL, SQLite, the other shared
libraries and extension modules.
"""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import sys
import time
from typing import Any

import psutil

from gpuwatch.bench.daemons import bench_daemon, nvitop_exporter
from gpuwatch.bench.harness import Context, Http, progress
from gpuwatch.bench.report import REFERENCE, REFERENCE_SOURCE, Row, Section, target
from gpuwatch.testing.daemon_process import ServerProcess, child_env

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
# (label, modules): imported in this order in one interpreter; each step's RSS is on top of the ones before.
# NVML_INIT as a step initialises NVML instead (the nvml backend only): libnvidia-ml and the driver's mappings.
NVML_INIT = "@nvmlInit"
IMPORT_LADDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("python alone", ()),
    ("stdlib: hashlib (OpenSSL's libcrypto)", ("hashlib",)),
    ("stdlib: json, logging, threading, socket", ("json", "logging", "threading", "socket")),
    ("stdlib: ssl (OpenSSL)", ("ssl",)),
    ("stdlib: asyncio", ("asyncio",)),
    ("stdlib: sqlite3", ("sqlite3",)),
    ("stdlib: http.server, urllib.request, email", ("http.server", "urllib.request", "email.message")),
    ("stdlib: logging.config, multiprocessing", ("logging.config", "multiprocessing")),
    ("prometheus_client", ("prometheus_client",)),
    ("psutil", ("psutil",)),
    ("click (the CLI)", ("click",)),
    ("uvicorn and httptools", ("uvicorn", "uvicorn.protocols.http.httptools_impl")),
    ("apscheduler", ("apscheduler.schedulers.background",)),
    ("gpuwatch: the trainer package (the config imports its contract)", ("gpuwatch.trainer",)),
    ("gpuwatch: config, model, rules, monitor", ("gpuwatch.config", "gpuwatch.node.monitor", "gpuwatch.backends.sim")),
    ("gpuwatch: reports, remediation", ("gpuwatch.remediation.service",)),
    ("gpuwatch: drills", ("gpuwatch.drills.service",)),
    ("gpuwatch: the rest of `gpuwatch run`", ("gpuwatch.cli", "gpuwatch.daemon")),
    ("pynvml", ("pynvml",)),
)
# The peer's, the same way: what it imports, then NVML.
PEER_LADDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("python alone", ()),
    ("nvitop-exporter's imports (nvitop, psutil, prometheus_client, pynvml)", ("nvitop_exporter",)),
)
NVML_STEP = ("NVML initialised (nvmlInit: libnvidia-ml, the driver's mappings)", (NVML_INIT,))
_LADDER_PROBE = (
    "import sys\n"
    "def rss(): return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS:'))\n"
    "for step in sys.argv[1:]:\n"
    "    for name in filter(None, step.split(',')):\n"
    "        if name == '@nvmlInit': import pynvml; pynvml.nvmlInit()\n"
    "        else: __import__(name)\n"
    "    print(rss(), flush=True)"
)
_MAPPING_PARTS = (  # (part, a pattern of the mapped file's path); the first that matches takes the mapping
    ("NVML (libnvidia-ml)", re.compile(r"libnvidia-ml")),
    ("other NVIDIA libraries", re.compile(r"libnvidia|libcuda")),
    ("libpython", re.compile(r"libpython")),
    ("OpenSSL (libcrypto, libssl)", re.compile(r"libcrypto|libssl")),
    ("SQLite", re.compile(r"libsqlite")),
    ("other shared libraries and extension modules", re.compile(r"\.so(\.|$)")),
)
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
    nvml = (NVML_STEP,) if ctx.backend == "nvml" else ()
    section.figures["import_ladder_mb"] = ladder = import_ladder((*IMPORT_LADDER, *nvml))
    for label, added in ladder.items():
        section.rows.append(Row(f"`gpuwatch run`'s imports, step by step: + {label}", added, "MiB"))
    if peer_status == "ok":
        section.figures["peer_ladder_mb"] = peer_ladder = import_ladder((*PEER_LADDER, *nvml))
        for label, added in peer_ladder.items():
            section.rows.append(Row(f"nvitop-exporter, step by step: + {label}", added, "MiB"))
    for name in ("gpuwatch_1s", "nvitop_exporter_1s"):
        for part, mib in figures.get(name, {}).get("rss_parts_mb", {}).items():
            section.rows.append(Row(f"{name} RSS: {part}", mib, "MiB"))
    return section


def import_ladder(ladder: tuple[tuple[str, tuple[str, ...]], ...] = IMPORT_LADDER) -> dict[str, float | None]:
    """MiB each step of `ladder` adds to one interpreter's RSS (the first: python alone); {} when it fails."""
    steps = [",".join(modules) for _, modules in ladder]
    probe = subprocess.run(
        [sys.executable, "-c", _LADDER_PROBE, *steps],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=child_env(),
    )
    values = [int(line) / 1024 for line in probe.stdout.split()]
    if probe.returncode != 0 or len(values) != len(ladder):
        return {}
    added = [values[0], *(b - a for a, b in zip(values, values[1:], strict=False))]
    return {label: mib for (label, _), mib in zip(ladder, added, strict=True)}


def rss_parts(pid: int) -> dict[str, float]:
    """The process's RSS (MiB) by what is mapped: Python's objects, libpython, NVML, OpenSSL, SQLite, ..."""
    parts: collections.Counter[str] = collections.Counter()
    part = ""
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as smaps:
            for line in smaps:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    fields = line.split(maxsplit=5)
                    part = _mapping_part(fields[5].strip() if len(fields) > 5 else "")
                elif line.startswith("Rss:"):
                    parts[part] += int(line.split()[1])
    except OSError:
        return {}
    return {name: kib / 1024 for name, kib in parts.most_common()}


def _mapping_part(path: str) -> str:
    if not path or path in ("[heap]", "[anon]") or path.startswith("[anon:"):
        return "Python's objects (anonymous memory, heap)"
    for part, pattern in _MAPPING_PARTS:
        if pattern.search(path):
            return part
    return "stacks, files and other mappings"


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
                "rss_parts_mb": rss_parts(proc.pid),
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
