"""Serving: /metrics latency and throughput under 1, 10 and 50 concurrent scrapers, side by side with peers.

Each client is a process with its own keep-alive connection (as each Prometheus server keeps one per
target); a level stops after a bounded number of requests or seconds, whichever comes first. The daemon runs at
a 1 s interval, so its Snapshot (and the cached exposition) changes every second while it is scraped.
Peers on the same machine: nvitop-exporter as its own process at a 1 s interval, and one
`nvidia-smi --query-gpu=… --format=csv` call per scrape (what nvidia_gpu_exporter does), timed bare.

Where the p99 goes: a timeline of ticks against requests. Each body names the Snapshot it came from
(gpuwatch_last_sample_timestamp_seconds, the tick's start); the first request that got a new body
ends that tick's window (the Snapshot was out and rendered by then). A request that overlaps a
window was served while a tick ran; the p99 of those and of the others, and the share of the slowest
1 % that overlapped a tick, say whether scrapes queue behind ticks.
"""

from __future__ import annotations

import http.client as http_client
import multiprocessing
import re
import shutil
import subprocess
import time
from typing import Any

from gpuwatch.bench.daemons import bench_daemon, nvitop_exporter
from gpuwatch.bench.harness import Context, Http, exposition_size, progress
from gpuwatch.bench.report import REFERENCE, REFERENCE_SOURCE, Row, Section, ratio, target
from gpuwatch.bench.stats import percentile, summarize

LEVELS = (1, 10, 50)
P99_TARGET_MS = 5.0
NVITOP_RATIO_TARGET = 8.0
TARGET_LEVEL = 10
WARM_UP_TIMEOUT_S = 120.0  # every client's first request, before the clock starts
_SNAPSHOT_T = re.compile(rb"^gpuwatch_last_sample_timestamp_seconds (\S+)$", re.MULTILINE)
NVIDIA_SMI_FIELDS = (
    "timestamp,index,uuid,name,driver_version,pstate,temperature.gpu,temperature.memory,utilization.gpu,"
    "utilization.memory,memory.total,memory.used,memory.free,power.draw,power.limit,clocks.sm,clocks.mem,"
    "clocks.max.sm,fan.speed,ecc.errors.corrected.aggregate.total,ecc.errors.uncorrected.aggregate.total,"
    "pcie.link.gen.current,pcie.link.width.current"
)


def run(ctx: Context) -> Section:
    section = Section("serving")
    with bench_daemon(ctx, "serving", interval_s=1.0) as daemon:
        progress(f"serving: gpuwatch /metrics at {', '.join(map(str, LEVELS))} clients")
        ours = _measure(ctx, daemon.port)
    theirs = _nvitop(ctx)
    smi = _nvidia_smi(ctx)
    section.figures = {"gpuwatch": ours, "nvitop_exporter": theirs, "nvidia_smi": smi}
    rows = section.rows
    size = ours["exposition"]
    rows.append(Row("gpuwatch exposition", size["bytes"] / 1e3, f"KB, {size['series']} series"))
    measured_peer = theirs["status"] == "ok"
    if measured_peer:
        size = theirs["exposition"]
        rows.append(Row("nvitop-exporter exposition", size["bytes"] / 1e3, f"KB, {size['series']} series"))
    else:
        rows.append(Row("nvitop-exporter", theirs["status"]))
    for clients in LEVELS:
        level = ours["levels"][str(clients)]
        p99 = level["p99_ms"]
        at = f"@ {clients} client{'s' if clients > 1 else ''}"
        rows.append(Row(f"gpuwatch p50 {at}", level["p50_ms"], "ms"))
        if clients == TARGET_LEVEL:
            rows.append(target(f"gpuwatch p99 {at}", p99, "ms", P99_TARGET_MS))
        else:
            rows.append(Row(f"gpuwatch p99 {at}", p99, "ms"))
        rows.append(Row(f"gpuwatch throughput {at}", level["throughput_rps"], "req/s"))
        ticks = level.get("ticks")
        if clients == TARGET_LEVEL and ticks:
            rows.append(Row(f"gpuwatch p99 {at}, requests overlapping a tick", ticks["during_p99_ms"], "ms"))
            rows.append(Row(f"gpuwatch p99 {at}, the other requests", ticks["outside_p99_ms"], "ms"))
            rows.append(Row(f"share of the slowest 1 % {at} that overlapped a tick", ticks["tail_share"] * 100, "%"))
        if measured_peer:
            peer = theirs["levels"][str(clients)]
            level["nvitop_p99_ratio"] = ratio(peer["p99_ms"], p99)
            rows.append(Row(f"nvitop-exporter p99 {at}", peer["p99_ms"], "ms"))
            rows.append(Row(f"nvitop-exporter throughput {at}", peer["throughput_rps"], "req/s"))
            label = f"nvitop-exporter p99 / gpuwatch p99 {at}"
            if clients == TARGET_LEVEL:
                rows.append(target(label, level["nvitop_p99_ratio"], "×", NVITOP_RATIO_TARGET, at_most=False))
            else:
                rows.append(Row(label, level["nvitop_p99_ratio"], "×"))
        elif clients == TARGET_LEVEL:
            reference = REFERENCE["nvitop_p99_ms_10_clients"]
            label = f"nvitop-exporter p99 ({reference:g} ms) / gpuwatch p99 {at}"
            value = ratio(reference, p99)
            rows.append(target(label, value, "×", NVITOP_RATIO_TARGET, at_most=False, against=REFERENCE_SOURCE))
    if smi["status"] == "ok":
        one = ours["levels"]["1"]
        rows.append(Row("nvidia-smi --query-gpu call p50", smi["p50_ms"], "ms"))
        rows.append(Row("nvidia-smi --query-gpu call p99", smi["p99_ms"], "ms"))
        smi["p50_ratio"] = ratio(smi["p50_ms"], one["p50_ms"])
        smi["p99_ratio"] = ratio(smi["p99_ms"], one["p99_ms"])
        rows.append(Row("nvidia-smi p50 / gpuwatch p50 @ 1 client", smi["p50_ratio"], "×"))
        rows.append(Row("nvidia-smi p99 / gpuwatch p99 @ 1 client", smi["p99_ratio"], "×"))
    else:
        rows.append(Row("nvidia-smi --query-gpu", smi["status"]))
    return section


def _measure(ctx: Context, port: int) -> dict[str, Any]:
    """Every level against one server, after a warm-up; plus the size of what it serves."""
    http = Http(port)
    try:
        body = b""
        for _ in range(20):
            body = http.request("GET", "/metrics")[1]
    finally:
        http.close()
    max_requests, max_s = int(ctx.pick(3000, 300)), ctx.pick(15.0, 2.0)
    levels = {str(c): _load(port, c, max_requests, max_s) for c in LEVELS}
    return {"status": "ok", "exposition": exposition_size(body), "levels": levels}


def _load(port: int, clients: int, max_requests: int, max_s: float) -> dict[str, Any]:
    """`clients` processes scraping /metrics back to back until `max_requests` in all or `max_s` seconds.

    Processes, not threads: ten Prometheus servers are ten processes, and ten client threads in one
    interpreter queue for its GIL (a switch interval is 5 ms), which lands in the measured latency.
    """
    spawn = multiprocessing.get_context("spawn")  # the bench process has threads: no fork
    barrier = spawn.Barrier(clients + 1)
    results = spawn.Queue()
    share = max(1, max_requests // clients)
    workers = [spawn.Process(target=_client, args=(port, share, max_s, barrier, results)) for _ in range(clients)]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=WARM_UP_TIMEOUT_S)
    started = time.perf_counter()
    outcomes: list[tuple[list[float], list[tuple[float, float, float | None]], int]] = [
        results.get(timeout=max_s + WARM_UP_TIMEOUT_S) for _ in workers
    ]
    elapsed = time.perf_counter() - started
    for worker in workers:
        worker.join()
    done = [x for latencies, _, _ in outcomes for x in latencies]
    errors = sum(e for _, _, e in outcomes)
    if not done:
        raise RuntimeError(f"no successful /metrics request at {clients} clients ({errors} errors)")
    result: dict[str, Any] = {
        "clients": clients,
        **summarize(done, "ms"),
        "errors": errors,
        "seconds": elapsed,
        "throughput_rps": len(done) / elapsed,
    }
    ticks = tick_overlap([r for _, timeline, _ in outcomes for r in timeline])
    if ticks is not None:
        result["ticks"] = ticks
    return result


def _client(port: int, max_requests: int, max_s: float, barrier: Any, results: Any) -> None:
    """One scraper process: connect, wait for the others, then scrape; report latencies and timeline."""
    latencies: list[float] = []
    timeline: list[tuple[float, float, float | None]] = []
    snapshot_of: dict[int, float | None] = {}  # body hash → the Snapshot it names (parsed once per body)
    errors = 0
    http = Http(port)
    try:
        try:
            http.request("GET", "/metrics")  # connect (and wait for a slow server) outside the measurement
        except (OSError, http_client.HTTPException):
            errors += 1
        barrier.wait()
        perf, wall = time.perf_counter, time.time
        deadline = perf() + max_s
        while perf() < deadline and len(latencies) + errors < max_requests:
            started, start = wall(), perf()
            try:
                status, body = http.request("GET", "/metrics")
            except (OSError, http_client.HTTPException):
                errors += 1
                continue
            if status != 200:
                errors += 1
                continue
            latencies.append(perf() - start)
            key = hash(body)
            if key not in snapshot_of:
                found = _SNAPSHOT_T.search(body)
                snapshot_of[key] = float(found.group(1)) if found else None
            timeline.append((started, latencies[-1], snapshot_of[key]))
    finally:
        http.close()
        results.put((latencies, timeline, errors))


def tick_overlap(requests: list[tuple[float, float, float | None]]) -> dict[str, Any] | None:
    """Split (wall start, seconds, Snapshot time) requests into those that overlapped a tick and the rest.

    None when the bodies do not name their Snapshot (a peer) or no tick fell inside the run.
    """
    requests.sort(key=lambda r: r[0])
    windows: list[tuple[float, float]] = []
    seen: set[float] = set()
    for started, _, snapshot_t in requests:
        if snapshot_t is None:
            return None
        if snapshot_t not in seen:
            seen.add(snapshot_t)
            windows.append((snapshot_t, started))
    windows = windows[1:]  # the first body's tick ran before the first request
    if not windows:
        return None

    def overlaps(started: float, seconds: float) -> bool:
        return any(begin <= started + seconds and started <= end for begin, end in windows)

    during = sorted(s for started, s, _ in requests if overlaps(started, s))
    outside = sorted(s for started, s, _ in requests if not overlaps(started, s))
    cut = percentile(sorted(s for _, s, _ in requests), 0.99)
    tail = [(started, s) for started, s, _ in requests if s >= cut]
    return {
        "ticks": len(windows),
        "during_n": len(during),
        "during_p99_ms": percentile(during, 0.99) * 1e3 if during else None,
        "outside_p99_ms": percentile(outside, 0.99) * 1e3 if outside else None,
        "tail_share": sum(overlaps(started, s) for started, s in tail) / len(tail),
    }


def _nvitop(ctx: Context) -> dict[str, Any]:
    service = nvitop_exporter(ctx, "serving")
    if service is None:
        return {"status": "not installed"}
    progress("serving: nvitop-exporter (interval 1 s) at the same levels")
    try:
        service.start()
    except RuntimeError as exc:
        service.stop()
        return {"status": f"failed to start: {exc}"}
    try:
        return _measure(ctx, service.port)
    except (OSError, RuntimeError) as exc:  # a peer that breaks under load is a finding, not our failure
        return {"status": f"failed under load: {type(exc).__name__}: {exc}"}
    finally:
        service.stop()


def _nvidia_smi(ctx: Context) -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"status": "not installed"}
    args = [exe, f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv"]
    calls = int(ctx.pick(50, 10))
    progress(f"serving: nvidia-smi --query-gpu ({NVIDIA_SMI_FIELDS.count(',') + 1} fields) × {calls}")
    first = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    if first.returncode != 0:
        lines = (first.stderr or first.stdout).strip().splitlines()
        return {"status": f"failed (exit {first.returncode}): {lines[-1] if lines else ''}"}
    durations = []
    for _ in range(calls):
        start = time.perf_counter()
        subprocess.run(args, capture_output=True, timeout=60, check=False)
        durations.append(time.perf_counter() - start)
    return {"status": "ok", "fields": NVIDIA_SMI_FIELDS.count(",") + 1, **summarize(durations, "ms")}
