"""Signals reach only the process meant: a pidfd, after checking that it is still the rank (start, user, program)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.model import TrainerInfo
from gpuwatch.node.ranks import Rank
from gpuwatch.remediation import signals

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def as_rank(pid: int, proc: ProcFs) -> Rank:
    identity = proc.identity(pid)
    assert identity is not None
    uid = identity.uids[0] if identity.uids else None
    return Rank(TrainerInfo(pid=pid, rank=0), 0, uid, identity.start_time, ("environ",), exe=identity.exe)


def test_the_rank_itself_is_signalled() -> None:
    proc = ProcFs()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert signals.send(as_rank(child.pid, proc), signal.SIGTERM, proc) == signals.SENT
        assert child.wait(5) == -signal.SIGTERM
    finally:
        child.kill()


def test_a_process_that_execd_another_program_is_refused() -> None:
    proc = ProcFs()
    execs = "signal.signal(signal.SIGUSR2, lambda *_: os.execv('/bin/sleep', ['sleep', '30']))"
    child = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; {execs}; time.sleep(30)"])
    try:
        time.sleep(0.3)
        rank = as_rank(child.pid, proc)  # seen while it ran the trainer
        os.kill(child.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while proc.identity(child.pid) is not None and proc.identity(child.pid).exe == rank.exe:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.02)

        assert signals.send(rank, signal.SIGTERM, proc) == signals.REFUSED
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_recycled_pid_is_gone_not_signalled() -> None:
    proc = ProcFs()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        rank = as_rank(child.pid, proc)
        older = Rank(rank.info, rank.gpu, rank.uid, (rank.start_time or 0) - 1, rank.sources, exe=rank.exe)
        assert signals.send(older, signal.SIGTERM, proc) == signals.GONE
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
