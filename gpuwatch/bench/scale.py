"""`gpuwatch bench --only scale`: a job's membership with thousands of simulated ranks, the fleet breaker
with thousands of simulated nodes.

Ranks (gpuwatch.bench.scale_ranks): the job's real store and coordinator in a process of their own,
the ranks simulated by clients that speak its wire, eight to a node. With GPUWATCH_BENCH_BEFORE set
to the root of an older checkout, the same run is made against that checkout's store with the ranks
doing what its job.py did (poll), for a before/after table.

Local ranks (gpuwatch.bench.scale_node): one daemon with hundreds of ranks on its node, how long they
take to be admitted and what a hang poll over them costs.

Nodes (gpuwatch.bench.scale_fleet): a real Prometheus (`prometheus` on PATH) with the project's
recording rules over synthetic node exports, asked what the breaker asks.

GPUWATCH_BENCH_SCALE_RANKS, GPUWATCH_BENCH_SCALE_LOCAL_RANKS and GPUWATCH_BENCH_SCALE_NODES
(comma-separated counts) choose the sizes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.report import Row, Section

RANKS = (1024, 4096, 16384)
QUICK_RANKS = (64, 512)
_ROOT = Path(__file__).resolve().parents[2]
_HOST = Path(__file__).with_name("scale_host.py")


def run(ctx: Context) -> Section:
    sizes = _sizes("GPUWATCH_BENCH_SCALE_RANKS", QUICK_RANKS if ctx.quick else RANKS)
    before = os.environ.get("GPUWATCH_BENCH_BEFORE")
    section = Section("scale")
    results: list[dict[str, Any]] = []
    for ranks in sizes:
        runs = [("push", str(_ROOT)), ("relay", str(_ROOT))] + ([("poll", before)] if before else [])
        for mode, code in runs:
            progress(f"scale: {ranks} simulated ranks, {mode} ({code})")
            figures = measure_ranks(ranks, mode, code, quick=ctx.quick)
            results.append(figures)
            section.rows.extend(_rows(figures))
    section.figures["ranks"] = results
    from gpuwatch.bench import scale_fleet, scale_node

    section.figures["local_ranks"] = scale_node.rows(ctx, section)

    section.figures["nodes"] = scale_fleet.run(ctx, section)
    return section


def measure_ranks(ranks: int, mode: str, code: str, *, quick: bool = False) -> dict[str, Any]:
    """One simulated job of `ranks` against the store of the checkout at `code` (its root)."""
    from gpuwatch.bench.scale_ranks import Job, simulate

    with tempfile.TemporaryDirectory(prefix="gpuwatch-scale-") as workdir:
        secret_file = Path(workdir) / "secret"
        secret = os.urandom(32).hex().encode()
        secret_file.write_bytes(secret)
        secret_file.chmod(0o600)
        nodes = (ranks + 7) // 8
        env = {**os.environ, "PYTHONPATH": code}
        host = subprocess.Popen(
            [sys.executable, str(_HOST), str(secret_file), str(nodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert host.stdin is not None and host.stdout is not None
        try:
            port = int(host.stdout.readline().split()[1])

            def stats() -> tuple[float, int]:
                assert host.stdin is not None and host.stdout is not None
                cpu = cpu_seconds(host.pid)  # first: a saturated store answers the line below late
                host.stdin.write("stats\n")
                host.stdin.flush()
                return cpu, int(host.stdout.readline().split()[1])

            job = Job(port, secret, mode)
            form_s = 60.0 if quick else 240.0
            timing = {"form_s": form_s, "idle_s": 2.0 if quick else 5.0, "change_s": 30.0 if quick else 120.0}
            figures = asyncio.run(simulate(job, ranks, stats, **timing))
            figures["code"] = "before" if mode == "poll" else "after"
            figures["store_rss_mb"] = rss_mb(host.pid)
            return figures
        finally:
            host.kill()
            host.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _rows(f: dict[str, Any]) -> list[Row]:
    label = f"{f['ranks']} ranks, {f['code']} ({f['mode']})"
    return [
        Row(f"{label}: forming the job", f.get("form_s"), "s"),
        Row(f"{label}: store CPU while idle", f.get("idle_store_cpu_pct"), "% of a core"),
        Row(f"{label}: requests while idle", f.get("idle_requests_per_s"), "/s"),
        Row(f"{label}: a request's round trip p50 / p99", _pair(f, "request"), "ms"),
        Row(f"{label}: a rank killed → every survivor saw it / met", _pair(f, "kill", "seen_s", "met_s"), "s"),
        Row(f"{label}: a rank killed: the store's CPU for the change", f.get("kill_store_cpu_s"), "s"),
        Row(f"{label}: a join → every member saw it / met", _pair(f, "join", "seen_s", "met_s"), "s"),
    ]


def _pair(f: dict[str, Any], name: str, first: str = "p50_ms", second: str = "p99_ms") -> str:
    def shown(value: Any) -> str:
        return "—" if value is None else str(value)

    return f"{shown(f.get(f'{name}_{first}'))} / {shown(f.get(f'{name}_{second}'))}"


def _sizes(variable: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = os.environ.get(variable, "")
    sizes = tuple(int(part) for part in value.split(",") if part.strip().isdigit())
    return sizes or default
