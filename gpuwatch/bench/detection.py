"""Detection: how soon a fault becomes visible in the API and in /metrics.

The real path of an XID is the kernel log: the driver writes `NVRM: Xid (PCI:…): 79, …` and the
daemon, waiting in select() on /dev/kmsg, judges it at once. The bench writes that line, in
/dev/kmsg's record format, to a FIFO the daemon follows as its `tools.kmsg` (the sim follows it with
`sim.kernel_log`), one GPU after another, and times line → finding in /v1/gpus/N and in /metrics
(goal: 50 ms). NVML's event set is the other source; with `nvml.events = auto` it is off on GPUs the
kernel log covers, so where the log is followed it is reported as off, and NVML's own delivery of a
real XID is measured on the H200 by tests/hardware. An XID injected with POST /v1/gpus/N/inject is
reported apart, as what it is: the injection path (it reaches the rules at the next tick where no
event set runs). A sustained fault (SM clock 500 MHz with HW slowdown under full load, injected
for longer than the window) is flagged once HW slowdown has held for `throttle_duty` of
`clock_window_s`: its figure is read against that window. The daemon samples every second and never
quarantines (the harness's policy), so an XID leaves every GPU and every process on it alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuwatch.backends.kmsg import pci_key
from gpuwatch.bench.daemons import bench_daemon
from gpuwatch.bench.harness import Context, Http, progress
from gpuwatch.bench.report import Row, Section, target
from gpuwatch.config import RulesConfig
from gpuwatch.serving import wire

EVENT_TARGET_S = 1.0
KERNEL_LOG_TARGET_S = 0.05
XID_LINE = "NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
EVENT_RULE = "xid_critical"
SUSTAINED_RULE = "clocks_hw_slowdown"
SUSTAINED_FIELDS = {"sm_clock_mhz": 500, "clocks_event_reasons": 8, "util_gpu_pct": 100}


def run(ctx: Context) -> Section:
    window_s = ctx.pick(RulesConfig.clock_window_s, 6.0)
    duty = RulesConfig.throttle_duty
    section = Section("detection")
    kernel = _kernel_log_path(ctx)
    with bench_daemon(ctx, "detection", interval_s=1.0, tables={"rules": {"clock_window_s": window_s}}) as daemon:
        http = Http(daemon.port)
        try:
            events = [_event(http, daemon.token, gpu) for gpu in range(min(ctx.gpus, 3))]
            gpu = ctx.gpus - 1
            progress(f"detection: sustained HW slowdown on GPU {gpu}, clock_window_s {window_s:g} s")
            sustained_s = _sustained(http, daemon.token, gpu, window_s)
        finally:
            http.close()
    api = max(e["api_s"] for e in events)
    metrics = max(e["metrics_s"] for e in events)
    kernel_api = max(e["api_s"] for e in kernel["runs"])
    kernel_metrics = max(e["metrics_s"] for e in kernel["runs"])
    section.figures = {
        "kernel_log": {"rule": EVENT_RULE, **kernel, "api_s_max": kernel_api, "metrics_s_max": kernel_metrics},
        "nvml_events": kernel["nvml_events"],
        "injection": {"rule": EVENT_RULE, "runs": events, "api_s_max": api, "metrics_s_max": metrics},
        "sustained": {
            "rule": SUSTAINED_RULE,
            "fields": SUSTAINED_FIELDS,
            "clock_window_s": window_s,
            "throttle_duty": duty,
            "expected_s": duty * window_s,
            "flagged_s": sustained_s,
        },
    }
    section.notes.append(f"XID 79 through NVML events: not measured here: {kernel['nvml_events']}")
    section.rows += [
        target("XID 79 kernel-log line → finding in /v1/gpus/N (worst)", kernel_api, "s", KERNEL_LOG_TARGET_S),
        target("XID 79 kernel-log line → finding in /metrics (worst)", kernel_metrics, "s", KERNEL_LOG_TARGET_S),
        target("XID 79 injected (API, injection path) → /v1/gpus/N (worst)", api, "s", EVENT_TARGET_S),
        target("XID 79 injected (API, injection path) → /metrics (worst)", metrics, "s", EVENT_TARGET_S),
        Row(f"HW slowdown expected after {duty:g} × window", duty * window_s, "s"),
        target(f"HW slowdown → {SUSTAINED_RULE} flagged", sustained_s, "s", window_s),
    ]
    return section


def _kernel_log_path(ctx: Context) -> dict[str, Any]:
    """A daemon following a FIFO as its kernel log: one XID 79 line per GPU, timed to the finding."""
    fifo = ctx.workdir / "detection-kmsg.fifo"
    tables: dict[str, dict[str, Any]] = {"tools": {"kmsg": str(fifo)}, "nvml": {"events": "auto"}}
    if ctx.backend == "sim":
        tables["sim"] = {"kernel_log": True}
    with _fifo(fifo) as writer, bench_daemon(ctx, "detection-kmsg", interval_s=1.0, tables=tables) as daemon:
        http = Http(daemon.port)
        try:
            gpus = wire.read(wire.GpuList, http.get_json("/v1/gpus"), "GET /v1/gpus").gpus[: min(ctx.gpus, 3)]
            runs = [_kernel_line(http, writer, gpu.index, gpu.pci_bus_id or "") for gpu in gpus]
        finally:
            http.close()
    why = (
        "sim has no NVML"
        if ctx.backend == "sim"
        else "off on GPUs the kernel log covers (nvml.events = auto); tests/hardware measures NVML's delivery"
    )
    return {"source": "FIFO in /dev/kmsg's record format", "runs": runs, "nvml_events": why}


@contextlib.contextmanager
def _fifo(path: Path) -> Iterator[int]:
    """A FIFO held open for writing (as /dev/kmsg is always there): the daemon's select() waits for a line."""
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def _kernel_line(http: Http, writer: int, gpu: int, pci_bus_id: str) -> dict[str, Any]:
    """Write one XID 79 record for `gpu`; seconds until the API, then /metrics, show its finding."""
    progress(f"detection: XID 79 line in the kernel log for GPU {gpu}")
    pci = pci_key(pci_bus_id)  # 00000000:18:00.0 → 0000:18:00, as the driver writes it
    usec = int((time.time() - _boot_time()) * 1e6)
    record = f"3,{usec},{usec},-;{XID_LINE.format(pci=pci)}\n".encode()
    start = time.perf_counter()
    os.write(writer, record)
    return _found(http, gpu, start)


def _boot_time() -> float:
    """/proc/stat's btime: the kernel log's records are dated in µs since boot."""
    with open("/proc/stat", encoding="ascii") as stat:
        return float(next(line.split()[1] for line in stat if line.startswith("btime ")))


def _event(http: Http, token: str, gpu: int) -> dict[str, Any]:
    """Inject XID 79 on `gpu`; seconds until the API, then /metrics, show its finding."""
    progress(f"detection: XID 79 injected on GPU {gpu}")
    start = time.perf_counter()
    http.post_json(f"/v1/gpus/{gpu}/inject", {"event": "xid", "xid": 79, "duration_s": 60}, token)
    return _found(http, gpu, start)


def _found(http: Http, gpu: int, start: float) -> dict[str, Any]:
    """Seconds from `start` until /v1/gpus/N, then /metrics, show the XID's finding on `gpu`."""
    while not _api_has(http, gpu, EVENT_RULE):
        _give_up_after(start, 10.0, f"{EVENT_RULE} on GPU {gpu} in /v1/gpus")
    api_s = time.perf_counter() - start
    needle = f'gpu="{gpu}"'.encode()
    rule = f'rule="{EVENT_RULE}"'.encode()
    while not any(
        line.startswith(b"gpuwatch_gpu_finding{") and needle in line and rule in line
        for line in http.request("GET", "/metrics")[1].splitlines()
    ):
        _give_up_after(start, 10.0, f"{EVENT_RULE} on GPU {gpu} in /metrics")
    return {"gpu": gpu, "api_s": api_s, "metrics_s": time.perf_counter() - start}


def _sustained(http: Http, token: str, gpu: int, window_s: float) -> float:
    """Inject the sustained fault on `gpu`; seconds until the rule flags it."""
    start = time.perf_counter()
    body = {"fields": SUSTAINED_FIELDS, "duration_s": 3 * window_s + 30}
    http.post_json(f"/v1/gpus/{gpu}/inject", body, token)
    while not _api_has(http, gpu, SUSTAINED_RULE):
        _give_up_after(start, 2 * window_s + 30, f"{SUSTAINED_RULE} on GPU {gpu}")
        time.sleep(0.05)
    return time.perf_counter() - start


def _api_has(http: Http, gpu: int, rule: str) -> bool:
    path = f"/v1/gpus/{gpu}"
    return any(f.rule == rule for f in wire.read(wire.Gpu, http.get_json(path), f"GET {path}").findings)


def _give_up_after(start: float, limit_s: float, what: str) -> None:
    if time.perf_counter() - start > limit_s:
        raise RuntimeError(f"no {what} within {limit_s:g} s")
