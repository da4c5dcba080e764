"""A stranger in an in-place job's process group runs no code and gets no state: mallory (a throwaway
local user) sits in a joining rank's gloo group in its peer's place, as she did by winning the race
for the peer's connection to gloo's listener, and sends what the state's source sends: a header by
`broadcast_object_list`, here a pickle that runs a command.

Three real processes: the victim (a joiner that holds nothing, with the job's secret), the rank that
holds the state (the job's secret too; mallory has its place in the first group, so its first
group never forms) and mallory (her own uid, no secret). The job's authenticated store is hosted
here. The victim must run none of her code, refuse that group with one line and a count, form the
group again with its real peer and receive the real state.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.inplace.jobstore import StoreServer
from tests.hardening.conftest import local_users
from tests.helpers import REPO

torch = pytest.importorskip("torch")
dist = torch.distributed

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user"),
    pytest.mark.slow,
]
SECRET = os.urandom(32).hex().encode()

RANK = r"""
import datetime, json, logging, os, sys
import torch, torch.distributed as dist
from gpuwatch.inplace.jobstore import JobStore
from gpuwatch.inplace.transfer import checksum, send_state
try:
    from gpuwatch.inplace.groupproof import form_group, refused
except ImportError:  # the code before groups proved themselves
    form_group = None
logging.basicConfig(level=logging.WARNING, format="%(message)s")
rank, job_port, mallory_port, secret = json.loads(sys.argv[1])
timeout = datetime.timedelta(seconds=10)
job = JobStore("127.0.0.1", job_port, secret.encode(), datetime.timedelta(seconds=30))

class Taken(dist.Store):
    # The victim's view after mallory won the race: the first group's connection is hers.
    def __init__(self):
        super().__init__()
        self.hers = dist.TCPStore("127.0.0.1", mallory_port, is_master=False, timeout=timeout)
    def _of(self, key):
        return self.hers if key.startswith("pg/1/") and not key.startswith("pg/1/proof/") else job
    def set(self, key, value): self._of(key).set(key, value)
    def get(self, key): return self._of(key).get(key)
    def add(self, key, value): return self._of(key).add(key, value)
    def check(self, keys): return all(self._of(k).check([k]) for k in keys)
    def wait(self, keys, timeout=None):
        for k in keys:
            self._of(k).wait([k], timeout) if timeout is not None else self._of(k).wait([k])
    def compare_set(self, key, expected, desired): return self._of(key).compare_set(key, expected, desired)
    def delete_key(self, key): return self._of(key).delete_key(key)
    def num_keys(self): return job.num_keys()

store = Taken() if rank == 1 else job
torch.manual_seed(rank)
model = torch.nn.Linear(16, 4)
optim = torch.optim.Adam(model.parameters(), lr=0.01)
if rank == 0:
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
if form_group is not None:
    attempt = form_group("gloo", store, "pg/1", rank, 2, timeout, secret.encode(), torch.device("cpu"), "generation 1")
elif rank == 1:
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/1", store), rank=1, world_size=2, timeout=timeout)
    attempt = 0
else:
    print(json.dumps({"old_code": True}), flush=True)
    sys.exit(0)
step, moved = send_state(model, optim, {}, 42 if rank == 0 else -1, 0)
print(json.dumps({"step": step, "checksum": checksum(model), "attempt": attempt,
                  "refused": refused() if form_group else 0}), flush=True)
"""

MALLORY = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
uid, port, marker = json.loads(sys.stdin.readline())
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
class Command:
    def __reduce__(self):
        return (os.system, (f"id -u > {marker}",))
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=90))
dist.init_process_group("gloo", store=dist.PrefixStore("pg/1", store), rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=90))
print("in the victim's group", flush=True)
try:
    dist.broadcast_object_list([Command()], src=0)
    print("header sent", flush=True)
except Exception as exc:
    print("broadcast failed:", type(exc).__name__, str(exc)[:200], flush=True)
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-group-mallory") as (user,):
        yield user.pw_uid


def test_a_stranger_in_the_group_runs_no_code_and_the_group_is_formed_again(tmp_path: Path, mallory: int) -> None:
    server = StoreServer("127.0.0.1", 0, SECRET)
    hers = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    marker = tmp_path / "ran-as-the-victim"
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    attacker = subprocess.Popen([sys.executable, "-c", MALLORY], stdin=subprocess.PIPE, **pipes)  # type: ignore[call-overload]
    try:
        attacker.stdin.write(json.dumps([mallory, hers.port, str(marker)]) + "\n")
        attacker.stdin.flush()
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, json.dumps([rank, server.port, hers.port, SECRET.decode()])], **pipes
            )  # type: ignore[call-overload]
            for rank in (0, 1)
        ]
        outs = [r.communicate(timeout=120) for r in ranks]
    finally:
        for p in (attacker, *locals().get("ranks", [])):
            if p.poll() is None:
                p.kill()
        said, said_err = attacker.communicate(timeout=30)
        server.close()
    print(f"\nmallory: {said.strip()!r} {said_err.strip()[-800:]}")
    for rank, (out, err) in enumerate(outs):
        print(f"rank {rank}: {out.strip()} | {err.strip()[-600:]}")

    assert not marker.exists(), f"mallory's pickle ran as the victim: {marker.read_text().strip()}"
    assert "in the victim's group" in said, "mallory never got into the group: the test proved nothing"
    (source_out, source_err), (victim_out, victim_err) = outs
    assert [r.returncode for r in ranks] == [0, 0], (source_err[-2000:], victim_err[-2000:])
    source, victim = json.loads(source_out.splitlines()[-1]), json.loads(victim_out.splitlines()[-1])
    assert victim["step"] == 42 and victim["checksum"] == source["checksum"], "the victim did not get the real state"
    assert victim["attempt"] >= 1 and victim["refused"] == victim["attempt"]
    assert victim_err.count("did not prove itself") == victim["attempt"], victim_err
