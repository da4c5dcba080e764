"""Detection: how soon a fault becomes visible in the API and in /metrics.

An event (XID 79 injected with POST /v1/gpus/N/inject) goes through Monitor.handle_events, the hand-off
the NVML event thread uses, and must be visible within 1 s; NVML's own delivery of a real XID is
measured on the H200 by tests/hardware. A sustained fault (SM clock 500 MHz with HW slowdown under
full load, injected for longer than the window) is flagged once HW slowdown has held for
`throttle_duty` of `clock_window_s`: its figure is read against that window. The daemon samples
every second and never quarantines (the harness's policy), so an injected XID 79 leaves every GPU
and every process on it alone.
"""

from __future__ import annotations

import time
from typing import Any

from gpuwatch import wire
from gpuwatch.bench.harness import Context, Http, bench_daemon, progress
from gpuwatch.bench.report import Row, Section, target
from gpuwatch.config import RulesConfig

EVENT_TARGET_S = 1.0
EVENT_RULE = "xid_critical"
SUSTAINED_RULE = "clocks_hw_slowdown"
SUSTAINED_FIELDS = {"sm_clock_mhz": 500, "clocks_event_reasons": 8, "util_gpu_pct": 100}


def run(ctx: Context) -> Section:
    window_s = ctx.pick(RulesConfig.clock_window_s, 6.0)
    duty = RulesConfig.throttle_duty
    section = Section("detection")
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
    section.figures = {
        "event": {"rule": EVENT_RULE, "runs": events, "api_s_max": api, "metrics_s_max": metrics},
        "sustained": {
            "rule": SUSTAINED_RULE,
            "fields": SUSTAINED_FIELDS,
            "clock_window_s": window_s,
            "throttle_duty": duty,
            "expected_s": duty * window_s,
            "flagged_s": sustained_s,
        },
    }
    section.rows += [
        target("XID 79 → finding in /v1/gpus/N (worst)", api, "s", EVENT_TARGET_S),
        target("XID 79 → finding in /metrics (worst)", metrics, "s", EVENT_TARGET_S),
        Row(f"HW slowdown expected after {duty:g} × window", duty * window_s, "s"),
        target(f"HW slowdown → {SUSTAINED_RULE} flagged", sustained_s, "s", window_s),
    ]
    return section


def _event(http: Http, token: str, gpu: int) -> dict[str, Any]:
    """Inject XID 79 on `gpu`; seconds until the API, then /metrics, show its finding."""
    progress(f"detection: XID 79 on GPU {gpu}")
    start = time.perf_counter()
    http.post_json(f"/v1/gpus/{gpu}/inject", {"event": "xid", "xid": 79, "duration_s": 60}, token)
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
