"""Nobody outside an in-place job reaches its membership: mallory (a throwaway local user) attacks the
store of a running 3-rank job (the example trainer under `gpuwatch launch --in-place`, sim daemon).

She finds the store as anyone would (`ss -ltnp`: the launcher's listening port) and tries what
worked before: torch's own TCPStore client to list and read the keys, forge a `gone` for a rank
(which made it abort) and append her own `join` (which got her a rank and the state); the job's own
client with a guessed secret; the secret file itself. Every attempt must fail, and the job must end
as if she had not been there: exit 0, every step once on every rank, generation 1 throughout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.conftest import local_users
from tests.inplace.jobs import assert_no_step_lost_or_repeated, launch_in_place, sim_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc"),
    pytest.mark.slow,
]
STEPS = 300

ATTACK = """
import datetime, encodings.idna, glob, json, os, sys
import torch.distributed as dist
try:
    from gpuwatch.inplace.jobstore import JobStore
except ImportError:
    JobStore = None
uid, port, job, secret_file = json.loads(sys.stdin.readline())  # imports done: the attack itself is quick
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
found = {}
def attempt(name, fn):
    try:
        found[name] = fn()
    except BaseException as exc:
        found[name] = "refused: " + type(exc).__name__ + ": " + str(exc)[:200]
prefix = "gpuwatch-inplace/" + job + "/"
def secret():
    with open(secret_file) as f:
        return f.read()
attempt("secret_file", secret)
attempt("secret_glob", lambda: [open(p).read() for p in glob.glob("/tmp/gpuwatch-inplace-*/secret")] or "refused")
store = None
def connect():
    global store
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
    return "connected"
attempt("connect", connect)
if store is not None:
    attempt("list_keys", lambda: store.list_keys())
    attempt("read", lambda: store.get(prefix + "gen").decode())
    def forge_gone():
        newest = json.loads(store.get(prefix + "gen/" + store.get(prefix + "gen").decode()))
        victim = newest["members"][0]
        index = store.add(prefix + "events", 1) - 1
        store.set(prefix + "event/%d" % index, json.dumps({"kind": "gone", "member": victim, "code": -9, "node": 0}))
        return "forged gone " + victim
    attempt("gone", forge_gone)
    def join():
        index = store.add(prefix + "events", 1) - 1
        store.set(prefix + "event/%d" % index, json.dumps({"kind": "join", "member": "n0.g7.77", "node": 0}))
        return "appended join"
    attempt("join", join)
if JobStore is not None:
    guess = b"0" * 64
    attempt("jobstore", lambda: JobStore("127.0.0.1", port, guess, datetime.timedelta(seconds=2)).get(prefix + "gen"))
print(json.dumps(found), flush=True)
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-inplace-mallory") as (user,):
        yield user.pw_uid


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on, as `ss` shows them to anyone."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            address, _, port = line.split()[3].rpartition(":")
            found.append((address, int(port)))
    return found


def secret_file_of(pid: int) -> str:
    """The secret file a rank was given (root reads the rank's environment; mallory cannot)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"GPUWATCH_INPLACE_SECRET_FILE=")), "")


def test_another_user_can_neither_read_nor_join_nor_make_a_rank_leave(tmp_path: Path, mallory: int) -> None:
    with sim_node(tmp_path / "node", gpus=3) as node:
        run = launch_in_place(node, tmp_path, STEPS)
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        attack = subprocess.Popen([sys.executable, "-c", ATTACK], text=True, **pipes)  # type: ignore[call-overload]
        # started now, so that torch's import is behind it when the job runs
        try:
            run.wait_for("3 ranks past step 20", lambda lines: len(run.ranks_at(20, 3)) == 3)
            ports = listening(run.process.pid)
            assert ports, "the launcher listens nowhere"
            (job_id,) = {r["job_id"] for r in node.get("/v1/trainers")["ranks"]}  # public, as before
            pids = sorted({ln["pid"] for ln in run.steps()})
            target = [mallory, ports[0][1], job_id, secret_file_of(pids[0])]
            out, err = attack.communicate(json.dumps(target) + "\n", timeout=120)
            assert attack.returncode == 0, err[-3000:]
            found = json.loads(out)
            attacked_at = max(ln["step"] for ln in run.steps())
        finally:
            if attack.poll() is None:
                attack.kill()
            _, stderr = run.output(60)  # the job's end (stopped if it has none within 60 s)
    code = run.process.returncode

    print(f"\nmallory against an in-place job's store at {ports}: {found}")
    refused = {name: str(what).startswith("refused") for name, what in found.items()}
    assert all(refused.values()) and set(refused) >= {"secret_file", "secret_glob", "connect", "jobstore"}, found
    assert all(address == "127.0.0.1" for address, _ in ports), ports  # loopback only, not *:PORT
    assert attacked_at < STEPS, "the attack ended after the job: it proved nothing"
    assert code == 0, stderr
    lines = run.steps()
    assert sorted({ln["pid"] for ln in lines}) == pids, "a rank left or a stranger's rank joined"
    assert {ln["generation"] for ln in lines} == {1}, "the membership changed"
    assert_no_step_lost_or_repeated(lines, pids)
    assert all([ln["step"] for ln in lines if ln["pid"] == pid] == list(range(1, STEPS + 1)) for pid in pids)
