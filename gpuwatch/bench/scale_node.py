"""The daemon's side of many local ranks: how long they take to be admitted, and what a hang poll costs.

A farm process forks the ranks (real processes: the daemon reads their /proc), each reporting over
the daemon's real report socket as TrainerLink does (a report every 2 s, its step page advanced
every 0.25 s). The daemon's part runs here: the runtime directory's socket and board, and the round
the remediation thread makes every HANG_POLL_S (read the reports and step pages, map the ranks,
judge their progress), timed by wall clock and by this thread's CPU time.

Run as a script (`python scale_node.py RANKS ROUNDS`) it imports gpuwatch from sys.path as given and
prints its figures as JSON: the bench points PYTHONPATH at an older checkout (GPUWATCH_BENCH_BEFORE)
for the "before" row, so this file uses only what every version has.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuwatch.base.procfs import ProcFs
from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.report import Row, Section
from gpuwatch.config import Config
from gpuwatch.model import Snapshot
from gpuwatch.node.ranks import map_ranks
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.remediation.judging import TrainerJudge
from gpuwatch.remediation.service import HANG_POLL_S

ROUNDS = 40
LOCAL_RANKS = (256,)
QUICK_LOCAL_RANKS = (64,)

_FARM = """
import json, os, sys, time
from pathlib import Path
from gpuwatch.trainer.channel import ReportSender, StepPageWriter
from gpuwatch.trainer.contract import REPORT_SOCKET, STEP_SLOT, STEP_T_SLOT
socket_path, count = Path(sys.argv[1]) / REPORT_SOCKET, int(sys.argv[2])
children = []
gate, opened = os.pipe()  # every rank starts when the last one is forked: at once, as a node's ranks do
for local in range(count):
    pid = os.fork()
    if pid:
        children.append(pid)
        continue
    os.close(opened)
    os.read(gate, 1)
    page = StepPageWriter(os.getpid())
    sender = ReportSender(socket_path, page.fd)
    step, next_report = 0, 0.0
    while True:
        step += 1
        page.ints[STEP_SLOT] = step
        page.floats[STEP_T_SLOT] = time.time()
        if time.monotonic() >= next_report:  # the link's report_interval_s; a refused connect retries then
            body = {"pid": os.getpid(), "t": time.time(), "job_id": "scale", "rank": local, "local_rank": local,
                    "world_size": count, "local_world_size": count, "step": step}
            sender.send(json.dumps(body).encode())
            next_report = time.monotonic() + 2.0
        time.sleep(0.25)
os.close(opened)
print("started", flush=True)
sys.stdin.read()
for pid in children:
    os.kill(pid, 9)
for pid in children:
    os.waitpid(pid, 0)
"""


def rows(ctx: Context, section: Section) -> list[dict[str, Any]]:
    """The local ranks' part of the scale section: rows added to `section`, the figures returned."""
    from gpuwatch.bench.scale import _sizes

    root = str(Path(__file__).resolve().parents[2])
    before = os.environ.get("GPUWATCH_BENCH_BEFORE")
    results = []
    for ranks in _sizes("GPUWATCH_BENCH_SCALE_LOCAL_RANKS", QUICK_LOCAL_RANKS if ctx.quick else LOCAL_RANKS):
        for code, where in [("after", root), *([("before", before)] if before else [])]:
            progress(f"scale: {ranks} local ranks on one daemon, {code} ({where})")
            figures = run(ranks, where, rounds=10 if ctx.quick else ROUNDS)
            figures["code"] = code
            results.append(figures)
            label = f"{ranks} local ranks, {code}"
            section.rows.extend(
                [
                    Row(f"{label}: every rank admitted", figures["admitted_s"], "s"),
                    Row(f"{label}: a hang poll, p50 / max", f"{figures['round_ms']} / {figures['round_p99_ms']}", "ms"),
                    Row(f"{label}: a hang poll's CPU", figures["round_cpu_ms"], "ms"),
                    Row(f"{label}: CPU at a poll every {HANG_POLL_S:g} s", figures["cpu_pct"], "% of a core"),
                ]
            )
    return results


def run(ranks: int, code: str, rounds: int = ROUNDS) -> dict[str, Any]:
    """`measure` in a process of its own, with the gpuwatch of the checkout at `code` (its root)."""
    answer = subprocess.run(
        [sys.executable, __file__, str(ranks), str(rounds)],
        env={**os.environ, "PYTHONPATH": code},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    figures: dict[str, Any] = json.loads(answer.stdout.splitlines()[-1])
    return figures


def measure(ranks: int, rounds: int = ROUNDS) -> dict[str, Any]:
    """Admit `ranks` forked ranks, then time `rounds` hang polls over them."""
    with tempfile.TemporaryDirectory(prefix="gpuwatch-scale-node-") as workdir:
        runtime = RuntimeDir(Path(workdir) / "run")
        runtime.prepare()
        farm = subprocess.Popen(
            [sys.executable, "-c", _FARM, str(runtime.path), str(ranks)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # refused connects say so, once per rank: the figures say it all
            text=True,
        )
        try:
            assert farm.stdout is not None and farm.stdout.readline() == "started\n"
            started = time.monotonic()
            admitted_s = _admitted(runtime, ranks, started)
            figures = _rounds(runtime, rounds)
            figures.update({"ranks": ranks, "admitted_s": admitted_s})
            return figures
        finally:
            assert farm.stdin is not None
            farm.stdin.close()
            farm.wait(timeout=60)
            runtime.close()


def _admitted(runtime: RuntimeDir, ranks: int, started: float, limit_s: float = 120.0) -> float | None:
    """Seconds until every rank's report is on the board (None: not within `limit_s`)."""
    while time.monotonic() - started < limit_s:
        if sum(1 for report in runtime.read_reports() if report.running) >= ranks:
            return round(time.monotonic() - started, 2)
        time.sleep(0.05)
    return None


def _rounds(runtime: RuntimeDir, rounds: int) -> dict[str, Any]:
    """What Remediation's hang poll does, `rounds` times, HANG_POLL_S apart."""
    proc = ProcFs()
    judge = TrainerJudge(Config().trainer, proc)
    snapshot = Snapshot(t=time.time(), backend="sim")
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.thread_time()
        reports = [r.info for r in runtime.read_reports() if r.running]
        ranks = map_ranks(snapshot.gpus, reports, proc, use_pids=False)
        judge.hangs(time.time(), ranks, snapshot)
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
        time.sleep(max(0.0, HANG_POLL_S - walls[-1]))
    cpu_s = statistics.median(cpus)
    return {
        "round_ms": round(1000 * statistics.median(walls), 2),
        "round_p99_ms": round(1000 * max(walls), 2),
        "round_cpu_ms": round(1000 * cpu_s, 2),
        "cpu_pct": round(100 * cpu_s / HANG_POLL_S, 1),  # of one core, at one hang poll every HANG_POLL_S
    }


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
