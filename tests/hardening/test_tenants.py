"""One local user can never touch another user's job: mallory attacks, victim trains (two throwaway users).

The daemon runs as root, as in production; the two users' processes are real, each running as its
own uid (they start as root, where the test's interpreter lives, and drop to that uid before they
connect, so the kernel names that uid to the daemon).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.base.unixsock import address as socket_address
from gpuwatch.remediation.incidents import USER_INCIDENTS_PER_MIN
from tests.hardening.conftest import local_users
from tests.helpers import SimNode, start_sim_node
from tests.reporting import SPIN, FakeRank

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates two users"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc"),
]

MARK_USR1 = "signal.signal(signal.SIGUSR1, lambda *_: open('/dev/shm/gw-usr1-' + str(os.getpid()), 'w').close())"
"""A rank that notes the stop signal in a file instead of stopping: whether it was signalled at all."""


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[int, int]]:
    """(mallory, victim): two throwaway local accounts, removed at the end."""
    with local_users("gw-mallory", "gw-victim") as (first, second):
        yield first.pw_uid, second.pw_uid


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    """A root daemon whose runtime dir every user can reach, as /run/gpuwatch is (pytest's tmp dirs are 0700)."""
    public = Path(tempfile.mkdtemp(prefix="gpuwatch-tenants-"))
    public.chmod(0o755)
    sim = start_sim_node(
        tmp_path,
        gpus=2,
        t0=time.time(),
        **{
            "runtime_dir": str(public / "run"),
            "trainer.grace_period_s": 5.0,
            "trainer.kill_after_s": 0.5,
            "trainer.hang_after_s": 10.0,
        },
    )
    yield sim
    sim.close()
    shutil.rmtree(public, ignore_errors=True)


@pytest.fixture
def ranks() -> Iterator[list[FakeRank]]:
    started: list[FakeRank] = []
    yield started
    for rank in started:
        rank.end()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/gw-usr1-{rank.pid}")


def start(ranks: list[FakeRank], uid: int, behaviour: str = MARK_USR1) -> FakeRank:
    rank = FakeRank(behaviour, uid=uid)
    ranks.append(rank)
    return rank


def report(sim: SimNode, process: FakeRank, gpu: int, job: str, step: int, **fields: Any) -> bool:
    return sim.report(process, gpu, job, step=step, first_step=1, **fields)


def signalled(rank: FakeRank) -> bool:
    return Path(f"/dev/shm/gw-usr1-{rank.pid}").exists()


def test_a_frozen_impostor_with_the_victims_job_id_gets_only_itself_stopped(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank]
) -> None:
    """mallory starts a process with the victim's job id and SIGSTOPs it; the victim's job pauses (an
    evaluation pass): only mallory's process is signalled."""
    mallory, victim = users
    victim_rank = start(ranks, victim, f"{MARK_USR1}\n{SPIN}")
    impostor = start(ranks, mallory)
    report(node, victim_rank, 0, "job-v", 100)
    report(node, impostor, 1, "job-v", 100)
    os.kill(impostor.pid, signal.SIGSTOP)

    deadline = time.monotonic() + 30
    while not any(i["status"] == "stopped" for i in node.incidents()):
        assert time.monotonic() < deadline, "mallory's frozen process was never found hung"
        node.clock.advance(1.0)
        report(node, victim_rank, 0, "job-v", 100)  # paused at step 100, busy evaluating
        node.daemon.monitor.tick()
        time.sleep(0.05)

    (incident,) = node.incidents()
    assert [(r["pid"], r["uid"]) for r in incident["ranks"]] == [(impostor.pid, mallory)]
    assert incident["uid"] == mallory
    assert impostor.wait(5) == -signal.SIGKILL
    assert victim_rank.poll() is None and not signalled(victim_rank)


def test_a_quarantine_stops_the_ranks_on_that_gpu_and_their_own_jobs_peers_only(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank]
) -> None:
    """mallory claims a rank of the victim's job id on the GPU being quarantined; the victim's rank runs on."""
    mallory, victim = users
    victim_rank = start(ranks, victim)
    claimed = start(ranks, mallory)
    report(node, victim_rank, 0, "job-v", 10)
    report(node, claimed, 1, "job-v", 10)
    node.daemon.monitor.tick()

    assert node.client.post("/v1/gpus/1/quarantine", json={"reason": "t"}, headers=node.auth).status_code == 200
    deadline = time.monotonic() + 10
    while not signalled(claimed):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    time.sleep(0.5)
    assert not signalled(victim_rank), "a rank of another user's job on a healthy GPU was stopped"


def test_nobody_can_fill_the_runtime_dir_and_a_connection_flood_hides_no_victim_rank(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime dir is root's; mallory's connections and 30,000 messages leave every victim rank seen."""
    mallory, victim = users
    runtime = Path(node.daemon.config.runtime_dir)
    as_mallory = ["setpriv", f"--reuid={mallory}", f"--regid={mallory}", "--clear-groups"]
    probe = subprocess.run([*as_mallory, "touch", str(runtime / "junk")], capture_output=True, text=True)
    assert probe.returncode != 0 and "Permission denied" in probe.stderr

    victims = [start(ranks, victim) for _ in range(3)]
    for i, rank in enumerate(victims):
        report(node, rank, 0, "job-v", 10, rank=i)
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD.replace("UID", str(mallory))],
        env={**os.environ, "SOCKET": str(node.daemon.runtime.socket_path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout is not None
        attempted, accepted = (int(n) for n in flood.stdout.readline().split())
        node.daemon.monitor.tick()
        seen = {r["pid"] for r in node.gpu(0)["trainers"]}
        assert {r.pid for r in victims} <= seen, "a victim rank was hidden"

        assert node.client.post("/v1/gpus/0/quarantine", json={"reason": "t"}, headers=node.auth).status_code == 200
        deadline = time.monotonic() + 10
        while not all(signalled(r) for r in victims):
            assert time.monotonic() < deadline, "a quarantine signalled only some victim ranks"
            time.sleep(0.05)
        refused = node.daemon.runtime.board.refused
        assert attempted >= 30_000 and refused["user_limit"] > 0 and refused["rate"] > 0, (attempted, accepted, refused)
    finally:
        flood.kill()
        flood.wait()


FLOOD = """
import json, os, socket, time
from gpuwatch.base.unixsock import address as socket_address
from pathlib import Path
os.setgroups([]); os.setresgid(UID, UID, UID); os.setresuid(UID, UID, UID)  # mallory, from here on
sockets, attempted, accepted = [], 0, 0
for _ in range(300):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with socket_address(Path(os.environ["SOCKET"])) as address:
            s.connect(address)
    except OSError:
        continue
    s.setblocking(False)
    sockets.append(s)
body = json.dumps({"t": time.time(), "pid": os.getpid(), "job_id": "job-v", "step": 1}).encode()
while attempted < 30000:
    for s in sockets or [None]:
        attempted += 1
        try:
            s.send(body)
            accepted += 1
        except (BlockingIOError, AttributeError):
            pass
        except OSError:
            sockets.remove(s)
print(attempted, accepted, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_flood_of_one_users_incidents_keeps_the_others(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank]
) -> None:
    """mallory's ranks die by the dozen: her incidents are bounded, the victim's real one is kept and watched."""
    mallory, victim = users
    real = start(ranks, victim)
    report(node, real, 0, "job-v", 10)
    node.daemon.monitor.tick()
    fakes = [start(ranks, mallory) for _ in range(int(USER_INCIDENTS_PER_MIN) + 10)]
    for i, fake in enumerate(fakes):
        report(node, fake, 1, f"fake-{i}", 10)
    node.daemon.monitor.tick()
    for fake in fakes:
        fake.kill()
    real.kill()

    deadline = time.monotonic() + 20
    while not any(i["uid"] == victim for i in node.incidents()):
        assert time.monotonic() < deadline, "the victim's incident is missing"
        time.sleep(0.1)
    time.sleep(1.0)
    by_user = [i["uid"] for i in node.incidents()]
    assert by_user.count(mallory) <= USER_INCIDENTS_PER_MIN
    (victims,) = [i for i in node.incidents() if i["uid"] == victim]
    assert victims["status"] in {"stopped", "stopping"}, "the victim's resume watch was ended by mallory's flood"


@pytest.mark.parametrize("program", ["/bin/sleep", "/usr/bin/su"])
def test_a_rank_that_execd_another_program_is_never_signalled(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank], program: str
) -> None:
    """pid and start time survive exec: the daemon checks the program and the uids when it signals."""
    _, victim = users
    if not Path(program).exists():
        pytest.skip(f"{program} is not here")
    argv = [program, "60"] if program.endswith("sleep") else [program, "-c", "sleep 60", "root"]
    execs = f"signal.signal(signal.SIGUSR2, lambda *_: os.execv({program!r}, {argv!r}))"
    rank = start(ranks, victim, execs)
    report(node, rank, 1, "job-v", 10)
    node.daemon.monitor.tick()
    os.kill(rank.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{rank.pid}/exe").resolve() == Path(sys.executable).resolve():
        assert time.monotonic() < deadline
        time.sleep(0.02)

    assert node.client.post("/v1/gpus/1/quarantine", json={"reason": "t"}, headers=node.auth).status_code == 200
    time.sleep(1.0)

    assert rank.poll() is None, f"pid {rank.pid}, now {program}, was signalled"
    (incident,) = node.incidents()
    assert all(r["ended"] == "not_a_rank" for r in incident["ranks"]), incident["ranks"]


def test_a_report_from_mallory_never_names_the_victim(node: SimNode, users: tuple[int, int]) -> None:
    """The report's pid field is refused when it is not the sender's: the kernel names who speaks."""
    mallory, _ = users
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with socket_address(node.daemon.runtime.socket_path) as address:
        sock.connect(address)
    with sock:
        sock.send(b'{"t": 1, "pid": 1, "job_id": "x"}')
        node.daemon.monitor.tick()
    assert node.daemon.runtime.board.refused["invalid"] == 1


def test_a_quarantine_of_two_users_jobs_records_one_incident_each(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank]
) -> None:
    """Each stopped job is its user's record: its own uid, job, ranks and resume, never "job-m,job-v"."""
    mallory, victim = users
    mallory_rank, victim_rank = start(ranks, mallory), start(ranks, victim)
    report(node, mallory_rank, 0, "job-m", 10)
    report(node, victim_rank, 0, "job-v", 20)
    node.daemon.monitor.tick()

    assert node.client.post("/v1/gpus/0/quarantine", json={"reason": "t"}, headers=node.auth).status_code == 200
    deadline = time.monotonic() + 10
    while not (signalled(mallory_rank) and signalled(victim_rank)):
        assert time.monotonic() < deadline, "a rank on the quarantined GPU was not signalled"
        time.sleep(0.05)

    records = {(i["uid"], i["job"]): [r["pid"] for r in i["ranks"]] for i in node.incidents()}
    assert records == {(mallory, "job-m"): [mallory_rank.pid], (victim, "job-v"): [victim_rank.pid]}


def test_a_stop_line_names_only_the_ranks_that_were_signalled(
    node: SimNode, users: tuple[int, int], ranks: list[FakeRank], caplog: pytest.LogCaptureFixture
) -> None:
    """A rank that exec'd another program is refused its signal: the "sent SIGUSR1" line does not name it."""
    _, victim = users
    execs = "signal.signal(signal.SIGUSR2, lambda *_: os.execv('/bin/sleep', ['/bin/sleep', '60']))"
    refused, signalled_rank = start(ranks, victim, execs), start(ranks, victim)
    report(node, refused, 1, "job-v", 10, rank=0)
    report(node, signalled_rank, 1, "job-v", 10, rank=1)
    node.daemon.monitor.tick()
    os.kill(refused.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{refused.pid}/exe").resolve() == Path(sys.executable).resolve():
        assert time.monotonic() < deadline
        time.sleep(0.02)

    with caplog.at_level(logging.WARNING, logger="gpuwatch.remediation"):
        assert node.client.post("/v1/gpus/1/quarantine", json={"reason": "t"}, headers=node.auth).status_code == 200
        while not signalled(signalled_rank):
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
        time.sleep(0.3)

    sent = [r.getMessage() for r in caplog.records if "sent SIG" in r.getMessage()]
    assert sent and all(f"pid {refused.pid}" not in line for line in sent), sent
    assert any(f"pid {signalled_rank.pid}" in line for line in sent), sent
