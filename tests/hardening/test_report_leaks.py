"""Report-socket connections speak for the process that made them, and no longer than it lives.

mallory (a throwaway local user) connects in a child and keeps the connection after the child
exits (the socket was made before the fork), as many times as the accept rate lets her: before,
every such connection stayed open in the daemon for good (descriptors until its limit, then no
report, API or control connection was accepted). Then a victim's process gets the dead child's pid
(root sets ns_last_pid) and reports; mallory's old connection must not speak for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.node.runtime import RuntimeDir
from tests.hardening.conftest import local_users
from tests.reporting import FakeRank

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user and picks pids"),
    pytest.mark.skipif(not Path("/proc/sys/kernel/ns_last_pid").exists(), reason="needs ns_last_pid"),
]
LEAKS = 100

MALLORY = r"""
import json, os, socket, sys, time
uid, path, leaks = json.loads(sys.stdin.readline())
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
held, last = [], None
for _ in range(leaks):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = os.fork()
    if child == 0:
        try:
            s.connect(path)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    held.append(s)
    last = child
    time.sleep(0.06)  # under the accept rate: each of them is taken
print(json.dumps({"held": len(held), "dead_pid": last}), flush=True)
sys.stdin.readline()  # the victim has her dead child's pid now
report = {"t": time.time(), "pid": last, "job_id": "victim-job", "gpu_uuid": "GPU-mallory", "step": 1}
try:
    held[-1].send(json.dumps(report).encode())
    print("sent", flush=True)
except OSError as exc:
    print("refused:", exc, flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def runtime() -> Iterator[RuntimeDir]:
    base = Path(tempfile.mkdtemp(prefix="gw-report-leaks-"))
    base.chmod(0o755)  # mallory may reach the socket, as under /run
    rt = RuntimeDir(base / "run")
    rt.prepare()
    yield rt
    rt.close()
    subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-leak-mallory") as (user,):
        yield user.pw_uid


def sockets_held() -> int:
    """This process's (the daemon's) open socket descriptors."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def spawn_with_pid(pid: int) -> FakeRank | None:
    """A victim's process that gets `pid` (the kernel's next pid set by root), None when another took it."""
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        rank = FakeRank()
        if rank.pid == pid:
            return rank
        rank.end()
    return None


@pytest.mark.slow
def test_a_connection_dies_with_its_process_and_never_speaks_for_the_next_one_with_its_pid(
    runtime: RuntimeDir, mallory: int
) -> None:
    before = sockets_held()
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    attack = subprocess.Popen([sys.executable, "-c", MALLORY], text=True, **pipes)  # type: ignore[call-overload]
    victim = None
    try:
        assert attack.stdin is not None and attack.stdout is not None
        attack.stdin.write(json.dumps([mallory, str(runtime.socket_path), LEAKS]) + "\n")
        attack.stdin.flush()
        deadline = time.monotonic() + 60
        said = ""
        while not said and time.monotonic() < deadline:
            runtime.read_reports()  # the daemon's ticks
            said = attack.stdout.readline()
        leak = json.loads(said)
        time.sleep(2.5)  # SWEEP_S twice, and margin
        runtime.read_reports()
        held = sockets_held() - before

        victim = spawn_with_pid(leak["dead_pid"])
        assert victim is not None, "no process got the dead child's pid"
        assert victim.report(runtime.path, t=time.time(), job_id="victim-job", gpu_uuid="GPU-victim", step=5)
        time.sleep(0.5)
        runtime.read_reports()
        attack.stdin.write("go\n")
        attack.stdin.flush()
        sent = attack.stdout.readline().strip()
        time.sleep(0.5)
        report = runtime.read_report(victim.pid)
    finally:
        if attack.poll() is None:
            attack.kill()
        attack.wait()
        if victim is not None:
            victim.end()
    print(f"\nmallory held {leak['held']} connections of dead children: the daemon holds {held} more sockets;"
          f" her report for pid {leak['dead_pid']}: {sent}; the daemon's report of that pid:"
          f" {report and (report.info.gpu_uuid, report.info.step, report.owner_uid)}")  # fmt: skip
    assert leak["held"] == LEAKS
    assert held <= 5, f"{held} connections of processes that are gone are still open in the daemon"
    assert report is not None and report.info.gpu_uuid == "GPU-victim" and report.owner_uid == 0, report
