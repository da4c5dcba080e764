"""`gpuwatch launch` without --in-place: another local user can neither use the workers' store nor join
their group.

The job's two gloo ranks meet through `init_process_group("gloo")` (env://, an unmodified script);
rank 1 loads its data for a few seconds first. mallory (a throwaway local user) finds the launch's
listening ports with `ss` and, on each, connects as torch's TCPStore client: she writes and reads a
key, and takes rank 1's place in the group (`init_process_group` as rank 1 on that store) before the
real rank 1 arrives, then all-reduces 1000s into the job's sums. The job must end 0 with every step's
sum right on both ranks, and she must reach no store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.conftest import local_users
from tests.hardening.test_rendezvous_pickle import attack_while_it_runs, launch_victim
from tests.inplace.jobs import sim_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user"),
    pytest.mark.slow,
]
STEPS = 30

TRAIN = f"""
import datetime, json, os, time, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
time.sleep(8 * rank)  # rank 1 loads its data
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
sums = []
for _ in range({STEPS}):
    t = torch.ones(1); dist.all_reduce(t); sums.append(t.item()); time.sleep(0.1)
with open(f"sums.{{rank}}.json", "w") as out:  # a file: torchrun's tee may drop a worker's last stdout lines
    json.dump({{"rank": rank, "sums": sums}}, out)
"""

MALLORY = r"""
import datetime, json, os, sys, threading, torch
import torch.distributed as dist
uid, ports = json.loads(sys.stdin.readline())
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
said = {"reached": [], "wrote": [], "read": [], "joined": False, "errors": []}
for port in ports:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
        said["reached"].append(port)
        store.set("mallory", "was here"); said["wrote"].append(port)
        said["read"].append(store.get("mallory").decode())
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=1, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        said["joined"] = True
        for _ in range(30):
            dist.all_reduce(torch.full((1,), 1000.0))
        break
    except Exception as exc:
        said["errors"].append(f"{port}: {type(exc).__name__}: {str(exc)[:120]}")
print(json.dumps(said), flush=True)
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-wstore-mallory") as (user,):
        yield user.pw_uid


def test_another_user_can_neither_use_the_workers_store_nor_join_their_group(tmp_path: Path, mallory: int) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    tmp_path.chmod(0o755)
    with sim_node(tmp_path / "node", gpus=2) as node:
        job = launch_victim(node, tmp_path, "victim-job", "--max-restarts", "0", env={"GLOO_SOCKET_IFNAME": "lo"})
        try:
            ports, said, err, (_, stderr) = attack_while_it_runs(job, MALLORY, lambda ports: [mallory, ports])
        finally:
            if job.poll() is None:
                job.kill()
    print(f"\nthe launch listens on {ports}; mallory: {said.strip()} {err.strip()[-300:]}")
    assert ports, "the launch listened nowhere before it ended: the attack proved nothing"
    hers = json.loads(said.splitlines()[-1])
    sums = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("sums.*.json"))]
    print(f"job exit {job.returncode}; sums {[(s['rank'], sorted(set(s['sums']))) for s in sums]}")
    assert hers["reached"] == [] and hers["read"] == [] and not hers["joined"], hers
    assert job.returncode == 0, stderr[-3000:]
    assert sorted(s["rank"] for s in sums) == [0, 1]
    assert all(s["sums"] == [2.0] * STEPS for s in sums), sums
