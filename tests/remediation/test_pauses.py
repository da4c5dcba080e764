"""A real daemon with the default config (30 s sampling) and real TrainerLink ranks: pauses are no hang, SIGSTOP is.

Each job is one rank stepping every 50 ms through a real TrainerLink, then pausing the way real
loops do: a blocking 12 s checkpoint save and an evaluation pass (both declared with
`link.pause`), a data-loader stall with the main thread idle for 8 s and a compile stand-in that
burns CPU for 12 s without a step (neither declared). None of them may be stopped; a rank frozen
by SIGSTOP (what the hang drill does) must be found within 5 s, and a rank whose main thread
blocks for good (a deadlock: no CPU time, no step, its link's thread still reporting) within its
stated limit, max(10 s, 20 × its p99 step), plus a margin. All jobs run at once: about 20 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, child_env
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

RANK = """
import os, sys, time
from gpuwatch.trainer import TrainerLink
runtime_dir, gpu_uuid, kind = sys.argv[1:4]

def steps(link, first, n):
    for step in range(first, first + n):
        time.sleep(0.05)
        link.step(step, 1.0)
    return first + n

def burn(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))

with TrainerLink(runtime_dir, report_interval_s=1.0, gpu_uuid=gpu_uuid) as link:
    step = steps(link, 1, 40)
    print("ready", flush=True)
    if kind == "checkpoint":
        with link.pause("checkpoint", up_to_s=60):
            time.sleep(12)  # a blocking save: the main thread waits on the disk
    elif kind == "eval":
        with link.pause("eval", up_to_s=60):
            burn(6)
            time.sleep(6)
    elif kind == "loader":
        time.sleep(8)  # the DataLoader's workers are behind: the main thread idles, undeclared
    elif kind == "compile":
        burn(12)  # torch.compile's first step on a new shape: CPU busy, no step, undeclared
    elif kind == "deadlock":
        print("frozen", flush=True)
        time.sleep(3600)  # the main thread waits on a lock no one releases; the link's thread reports on
    else:
        step = steps(link, step, 400)  # the one to be stopped
    steps(link, step, 20)
    print("done", flush=True)
"""
KINDS = ("checkpoint", "eval", "loader", "compile", "deadlock", "stopped")
HEALTHY = KINDS[:4]
STOPPED_FOUND_S = 5.0
FROZEN_LIMIT_S = 10.0  # trainer.hang_frozen_after_s: 20 × a 50 ms step is less
FROZEN_MARGIN_S = 5.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "daemon", "--sim-gpus", str(len(KINDS)), cwd=REPO) as node:
        yield node


def start_rank(node: DaemonProcess, gpu: dict[str, Any], kind: str) -> subprocess.Popen[str]:
    env = {**child_env(), "GPUWATCH_JOB_ID": f"job-{kind}", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    argv = [sys.executable, "-c", RANK, str(node.runtime_dir), gpu["uuid"], kind]
    return subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)


def hang_incidents(node: DaemonProcess) -> list[dict[str, Any]]:
    return [i for i in node.get("/v1/incidents?limit=100")["incidents"] if i["kind"] == "trainer_hang"]


@pytest.mark.slow
def test_declared_and_undeclared_pauses_keep_running_and_a_stopped_rank_is_found_within_5_s(
    daemon: DaemonProcess,
) -> None:
    gpus = daemon.get("/v1/gpus")["gpus"]
    ranks = {kind: start_rank(daemon, gpu, kind) for kind, gpu in zip(KINDS, gpus, strict=False)}
    try:
        for rank in ranks.values():
            assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        deadlock = ranks["deadlock"]
        assert deadlock.stdout is not None and deadlock.stdout.readline().strip() == "frozen"
        froze_at = time.monotonic()
        stopped = ranks["stopped"]
        os.kill(stopped.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        found: list[dict[str, Any]] = []
        while not found and time.monotonic() - frozen_at < 20:
            found = hang_incidents(daemon)
            time.sleep(0.05)
        found_s = time.monotonic() - frozen_at

        assert [i["job"] for i in found] == ["job-stopped"], daemon.log_tail()
        assert "is stopped (SIGSTOP)" in found[0]["reason"]
        assert found_s <= STOPPED_FOUND_S, f"the stopped rank was found after {found_s:.1f} s"

        frozen: list[dict[str, Any]] = []
        while not frozen and time.monotonic() - froze_at < FROZEN_LIMIT_S + 3 * FROZEN_MARGIN_S:
            frozen = [i for i in hang_incidents(daemon) if i["job"] == "job-deadlock"]
            time.sleep(0.05)
        frozen_s = time.monotonic() - froze_at
        assert frozen and "used no CPU time on its main thread" in frozen[0]["reason"], daemon.log_tail()
        assert FROZEN_LIMIT_S - 2 <= frozen_s <= FROZEN_LIMIT_S + FROZEN_MARGIN_S, f"found after {frozen_s:.1f} s"

        for kind in HEALTHY:
            out, _ = ranks[kind].communicate(timeout=60)
            assert (ranks[kind].returncode, out.split()[-1:]) == (0, ["done"]), kind
        jobs = sorted(i["job"] for i in hang_incidents(daemon))
        assert jobs == ["job-deadlock", "job-stopped"], "a pause was taken for a hang"
        print(f"\nstopped rank found {found_s:.2f} s after SIGSTOP; frozen main thread found {frozen_s:.2f} s after")
    finally:
        for rank in ranks.values():
            if rank.poll() is None:
                os.kill(rank.pid, signal.SIGCONT)
                rank.kill()
            rank.communicate()
