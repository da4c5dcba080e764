"""Simulated nodes against a real Prometheus with the project's rules: what the fleet breaker costs it.

One exporter of this process serves every simulated node's series (the families the fleet rules and
the breaker read: eight GPUs' info, health state, quarantine and epoch, and the node's Slurm drain),
each node's with its own `instance` label (Prometheus keeps them: honor_labels), split over a few
scrape targets so no one scrape is huge. `prometheus` (Debian's package) loads the project's
recording and alert rules, or an older checkout's (GPUWATCH_BENCH_BEFORE) for the "before" row.

Measured once the series are in and every rule group has been evaluated: the series, Prometheus's
RSS, each rule group's evaluation time (as Prometheus reports it), and a node's breaker asks (the
share, and the drained count as that version asks it) p50 / p99, one at a time and 50 at once.
The daily rules see minutes of samples here, not a day's: their cost at a day is extrapolated in
docs/performance.md, not measured.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.report import Row, Section

NODES = (1000, 10000)
QUICK_NODES = (100,)
GPUS = 8
PER_TARGET = 250  # nodes a scrape target serves (a scrape of about 1.5 MB)
SCRAPE_S = 15
STATES = ("healthy", "degraded", "unhealthy")
OLD_DRAINED = "count(max_over_time(gpuwatch_slurm_drained[3600s]) == 1) or vector(0)"  # the query every node made
SHARE = "fleet:gpuwatch_gpus_quarantined:ratio"
_RULES = Path("dashboards") / "prometheus"


def run(ctx: Context, section: Section) -> list[dict[str, Any]]:
    """The nodes' half of the scale section: rows added to `section`, the figures returned."""
    import os

    from gpuwatch.bench.scale import _sizes

    binary = shutil.which("prometheus")
    if binary is None:
        section.notes.append("prometheus is not installed: no simulated nodes (Debian: apt-get install prometheus)")
        return []
    root = Path(__file__).resolve().parents[2]
    before = os.environ.get("GPUWATCH_BENCH_BEFORE")
    results = []
    for nodes in _sizes("GPUWATCH_BENCH_SCALE_NODES", QUICK_NODES if ctx.quick else NODES):
        for code, where in [("after", root), *([("before", Path(before))] if before else [])]:
            progress(f"scale: {nodes} simulated nodes against Prometheus with the {code} rules")
            figures = measure_nodes(binary, nodes, where / _RULES, drained=OLD_DRAINED if code == "before" else None)
            figures["code"] = code
            results.append(figures)
            label = f"{nodes} nodes, {code}"
            section.rows.extend(
                [
                    Row(f"{label}: series", figures["series"]),
                    Row(f"{label}: Prometheus RSS", figures["rss_mb"], "MiB"),
                    Row(f"{label}: slowest rule group per evaluation", figures["slowest_group_s"], "s"),
                    *(
                        Row(f"{label}: rule group {name}, evaluation (of its interval)", f"{spent} s ({load:.1%})")
                        for name, spent in figures["groups_s"].items()
                        for load in [figures["group_load"][name]]
                    ),
                    Row(f"{label}: the share, p50 / p99", _pair(figures["share_ms"]), "ms"),
                    Row(f"{label}: the drained count, p50 / p99", _pair(figures["drained_ms"]), "ms"),
                    Row(f"{label}: 50 drained asks at once, answered within 2 s", figures["burst_answered"]),
                ]
            )
    return results


def exposition(first: int, count: int) -> bytes:
    """The series of nodes first..first+count-1, as each node's /metrics has them (a few quarantined, one drained)."""
    lines = []
    for node in range(first, first + count):
        where = f'instance="node{node}:9835",job="gpuwatch",cluster="c{node % 4}"'
        lines.append(f"gpuwatch_slurm_drained{{{where}}} {1 if node % 997 == 0 else 0}")
        for gpu in range(GPUS):
            g = f'{where},gpu="{gpu}",uuid="GPU-{node:05d}-{gpu}"'
            bad = (node * GPUS + gpu) % 101 == 0
            lines.append(f'gpuwatch_gpu_info{{{g},name="NVIDIA H100",pci_bus_id="0000:{gpu:02x}:00.0"}} 1')
            for state in STATES:
                on = state == ("unhealthy" if bad else "healthy")
                lines.append(f'gpuwatch_gpu_health_state{{{g},state="{state}",drill="false"}} {int(on)}')
            lines.append(f'gpuwatch_gpu_quarantined{{{g},drill="false"}} {int(bad)}')
            lines.append(f"gpuwatch_gpu_quarantine_epoch{{{g}}} {int(bad)}")
    return ("\n".join(lines) + "\n").encode()


class _Exporter:
    """Serves /metrics/<part>: PER_TARGET nodes each."""

    def __init__(self, nodes: int) -> None:
        parts = [exposition(first, min(PER_TARGET, nodes - first)) for first in range(0, nodes, PER_TARGET)]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = parts[int(self.path.rsplit("/", 1)[1])]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.parts = len(parts)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def measure_nodes(binary: str, nodes: int, rules: Path, drained: str | None) -> dict[str, Any]:
    """One Prometheus over `nodes` simulated nodes with the rules in `rules`; its figures."""
    import yaml

    from gpuwatch.bench.scale import rss_mb
    from gpuwatch.cluster.fleet import Prometheus, drained_nodes_query
    from gpuwatch.testing.daemon_process import free_port

    exporter = _Exporter(nodes)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpuwatch-scale-prom-") as workdir:
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(rules.resolve() / name) for name in ("gpuwatch-recording.yml", "gpuwatch-alerts.yml")],
            "scrape_configs": [
                {
                    "job_name": f"sim{part}",
                    "honor_labels": True,
                    "scrape_timeout": "14s",
                    "metrics_path": f"/metrics/{part}",
                    "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}],
                }
                for part in range(exporter.parts)
            ],
        }
        (Path(workdir) / "prometheus.yml").write_text(yaml.safe_dump(config))
        argv = [
            binary,
            f"--config.file={workdir}/prometheus.yml",
            f"--storage.tsdb.path={workdir}/tsdb",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        log = open(Path(workdir) / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            client = Prometheus(url, 10.0)
            _wait(lambda: client.scalar("count(gpuwatch_gpu_info)") >= nodes * GPUS, 600)
            time.sleep(SCRAPE_S)  # an evaluation after every series is in
            _wait(lambda: _evaluated(url), 120)
            groups = _groups(url)
            intervals = _intervals(url)
            share = _timed(lambda: client.scalar(SHARE), 50)
            drained_query = drained or drained_nodes_query(3600)
            drained_ms = _timed(lambda: client.scalar(drained_query), 50)
            burst = Prometheus(url, 2.0)
            with ThreadPoolExecutor(50) as pool:
                answers = list(pool.map(lambda _: _answered(burst, drained_query), range(50)))
            return {
                "nodes": nodes,
                "series": _head_series(url),
                "rss_mb": rss_mb(process.pid),
                "groups_s": groups,
                "slowest_group_s": max(groups.values()) if groups else None,
                "group_load": {name: round(spent / intervals[name], 3) for name, spent in groups.items()},
                "share_ms": share,
                "drained_ms": drained_ms,
                "drained_query": drained_query,
                "burst_answered": sum(answers),
            }
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a large head takes long to close: its figures are taken
                process.kill()
                process.wait()
            log.close()
            exporter.server.shutdown()


def _evaluated(url: str) -> bool:
    """Every rule group of a short interval has run (a daily group's first turn may be minutes away)."""
    groups = [g for g in _rules(url) if float(g.get("interval", 0)) <= 60]
    return bool(groups) and all(float(g.get("evaluationTime", 0)) > 0 for g in groups)


def _head_series(url: str) -> int:
    with urllib.request.urlopen(f"{url}/api/v1/status/tsdb", timeout=10) as answer:
        return int(json.loads(answer.read())["data"]["headStats"]["numSeries"])


def _rules(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=10) as answer:
        return list(json.loads(answer.read())["data"]["groups"])


def _groups(url: str) -> dict[str, float]:
    """Each group's evaluation time, the larger of two readings one evaluation apart."""

    def named(groups: list[dict[str, Any]]) -> dict[str, float]:  # two files may name a group alike
        return {f"{Path(g['file']).stem}:{g['name']}": float(g["evaluationTime"]) for g in groups}

    first = named(_rules(url))
    time.sleep(SCRAPE_S)
    second = named(_rules(url))
    times = {name: round(max(first.get(name, 0.0), second.get(name, 0.0)), 4) for name in second}
    return {name: spent for name, spent in times.items() if spent > 0}  # a group not run yet says nothing


def _intervals(url: str) -> dict[str, float]:
    """Each group's evaluation interval in seconds, named as `_groups` names them."""
    return {f"{Path(g['file']).stem}:{g['name']}": float(g["interval"]) for g in _rules(url)}


def _timed(ask: Any, times: int) -> dict[str, float]:
    spans = []
    for _ in range(times):
        started = time.monotonic()
        ask()
        spans.append(time.monotonic() - started)
    spans.sort()
    return {"p50": round(1000 * spans[len(spans) // 2], 2), "p99": round(1000 * spans[-1], 2)}


def _answered(client: Any, query: str) -> bool:
    try:
        client.scalar(query)
        return True
    except Exception:
        return False


def _wait(check: Any, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # not up yet, or the series not all in
            pass
        time.sleep(1.0)
    raise TimeoutError(f"Prometheus did not get there in {limit_s:g} s")


def _pair(figures: dict[str, float]) -> str:
    return f"{figures['p50']} / {figures['p99']}"
