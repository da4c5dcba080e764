"""A connect storm on the report socket costs the storming user: the daemon's report thread stays under its
CPU bound (docs/runtime-dir.md) and another user's rank connects at once, during the storm.

Two throwaway users: the stormer connects and closes as fast as one process can for 10 s; the
victim's rank (a real process of the victim's uid) sends its first report in the middle of it.
The report thread's CPU time comes from /proc/self/task/<tid>/stat (the daemon's real server,
in this process).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.reports.server import STORM_CPU_SHARE
from tests.hardening.conftest import local_users
from tests.reporting import FakeRank

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates two users"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc"),
]

STORM_S = 10.0
STORM = """
import os, socket, sys, time
from gpuwatch.base.unixsock import address as socket_address
from pathlib import Path
uid = int(sys.argv[2])
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # the stormer, from here on
tries = full = 0
end = time.monotonic() + float(sys.argv[3])
with socket_address(Path(sys.argv[1])) as address:
    print("storming", flush=True)
    while time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        tries += 1
        try:
            s.connect(address)
        except BlockingIOError:
            full += 1
        except OSError:
            pass
        s.close()
print(tries, full, flush=True)
"""
CONNECTS = """
import json, os, sys, time
from pathlib import Path
from gpuwatch.trainer.channel import ReportSender
uid = int(sys.argv[2])
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # the victim, from here on
failed, slowest = 0, 0.0
for _ in range(20):  # a rank's first report on a new connection, once every 0.1 s
    sender = ReportSender(Path(sys.argv[1]), None)
    started = time.monotonic()
    sent = sender.send(json.dumps({"pid": os.getpid(), "t": time.time(), "job_id": "job-c", "step": 1}).encode())
    slowest = max(slowest, time.monotonic() - started)
    failed += not sent
    sender.close()
    time.sleep(0.1)
print(failed, round(slowest, 3), flush=True)
"""


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[int, int]]:
    """(stormer, victim): two throwaway local accounts, removed at the end."""
    with local_users("gw-stormer", "gw-stormvictim") as (first, second):
        yield first.pw_uid, second.pw_uid


@pytest.fixture
def runtime() -> Iterator[RuntimeDir]:
    """The daemon's runtime dir with its real report server, where every user can reach the socket."""
    public = Path(tempfile.mkdtemp(prefix="gpuwatch-storm-"))
    public.chmod(0o755)
    served = RuntimeDir(public / "run")
    served.prepare()
    yield served
    served.close()
    shutil.rmtree(public, ignore_errors=True)


def _cpu_s(tid: int) -> float:
    """utime + stime of one thread of this process, in seconds."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_connect_storm_keeps_the_report_thread_bounded_and_another_users_rank_connects_at_once(
    users: tuple[int, int], runtime: RuntimeDir
) -> None:
    stormer, victim = users
    thread = runtime.server._thread
    assert thread is not None and thread.native_id is not None
    rank = FakeRank(uid=victim)  # started (interpreter and imports) before the storm
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    storm = subprocess.Popen(
        [sys.executable, "-c", STORM, str(runtime.socket_path), str(stormer), str(STORM_S)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert storm.stdout is not None and storm.stdout.readline() == "storming\n"
        time.sleep(1.0)  # the storm is at full speed
        cpu0, t0 = _cpu_s(thread.native_id), time.monotonic()
        connects = subprocess.run(
            [sys.executable, "-c", CONNECTS, str(runtime.socket_path), str(victim)],
            capture_output=True, text=True, env=env, timeout=30,
        )  # fmt: skip
        sent_at = time.monotonic()
        sent = rank.report(runtime.path, t=time.time(), job_id="job-v", step=1)
        connect_s = time.monotonic() - sent_at
        tries, full = (int(n) for n in storm.stdout.readline().split())
        cpu1, t1 = _cpu_s(thread.native_id), time.monotonic()
        assert storm.wait(timeout=10) == 0
    finally:
        storm.kill()
        storm.wait()
        rank.end()
    share = (cpu1 - cpu0) / (t1 - t0)
    runtime.server.poll()
    seen = {r.info.pid for r in runtime.board.reports()}
    assert connects.returncode == 0, connects.stderr
    failed, slowest = connects.stdout.split()
    assert failed == "0", f"{failed} of 20 ranks' first reports did not get through (slowest {slowest} s)"
    assert float(slowest) < 1.0, f"a rank's first report took {slowest} s"
    assert sent and rank.pid in seen, f"the victim's rank was not taken in during the storm ({connect_s:.2f} s)"
    assert connect_s < 1.0, f"the victim's rank waited {connect_s:.2f} s"
    assert runtime.board.refused["rate"] > 0, (tries, full)
    assert share < STORM_CPU_SHARE + 0.15, f"report thread at {share:.0%} of a core during {tries} connects"
