"""The rescue on gloo, two real processes: one rank hangs (SIGSTOP), the other is told to stop while
blocked in the collective, gets out and saves its last completed step alone, with no collective call.

gloo cannot be aborted (torch 2.13: ProcessGroupGloo.abort() and shutdown() leave a pending recv
waiting), so the blocked all_reduce ends at the process group's timeout (3 s here); what the test
pins is that the stop is seen at once while the main thread is stuck in C (the report says so
within a second), that the rank leaves within the timeout plus a little, and that its checkpoint verifies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import free_port
from gpuwatch.trainer import load_latest
from tests.reporting import ServeReports, report_fields

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
GLOO_TIMEOUT_S = 3
RANK = r"""
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
from gpuwatch.trainer import TrainerLink, save_checkpoint

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[2])))
state = torch.zeros(4)
with TrainerLink(sys.argv[1], report_interval_s=3600, abort_after_s=0.5) as link:
    save = lambda step: save_checkpoint(sys.argv[3], step, {"state": state}, single_writer=True)
    for step in range(1, 1000):
        with link.rescue(save):
            grad = torch.ones(4)
            dist.all_reduce(grad)
        state += grad
        link.step(step)
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.01)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_a_rank_blocked_by_a_hung_peer_gets_out_saves_and_exits_75(tmp_path: Path, serve_reports: ServeReports) -> None:
    runtime_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    runtime = serve_reports(runtime_dir)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        command = [sys.executable, "-c", RANK, str(runtime_dir), str(GLOO_TIMEOUT_S), str(ckpt)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    survivor, hung = procs
    try:
        deadline = time.monotonic() + 60
        while _state(hung.pid) != "T":  # rank 1 stopped itself after step 5; rank 0 waits in step 6's all_reduce
            assert time.monotonic() < deadline and hung.poll() is None, hung.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        assert survivor.poll() is None and report_fields(runtime, survivor.pid)["stop_requested"] is False

        told = time.monotonic()
        os.kill(survivor.pid, signal.SIGUSR1)  # what the daemon does
        while report_fields(runtime, survivor.pid).get("stop_requested") is not True:
            assert time.monotonic() - told < 1.0, "the stop was not seen while the main thread was in gloo"
            time.sleep(0.01)
        _, stderr = survivor.communicate(timeout=GLOO_TIMEOUT_S + 30)
        took = time.monotonic() - told
    finally:
        os.kill(hung.pid, signal.SIGKILL)
        hung.communicate()
        survivor.kill()

    assert survivor.returncode == 75, stderr
    assert took < GLOO_TIMEOUT_S + 5, took
    assert "gloo process groups cannot be aborted" in stderr
    report = report_fields(runtime, survivor.pid)
    assert (report["ended"], report["step"], report["stop_requested"]) == ("resume", 5, True)
    loaded = load_latest(ckpt)
    assert loaded is not None and loaded.step == 5
    assert loaded.state["state"].tolist() == [10.0] * 4  # five completed steps of all_reduce(1) over 2 ranks
    print(f"\ngloo rescue: stop seen while blocked, out and saved {took:.2f} s after the stop signal")
