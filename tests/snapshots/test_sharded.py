"""Sharded state (FSDP2 on a CPU mesh, gloo, 2 real ranks): each rank snapshots its own shards, and a job
whose ranks all restart reloads them from host memory into DTensors; another world size gets none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
JOB = "sharded"

WORKER = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from gpuwatch.snapshots import HostSnapshot

phase, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
optim = torch.optim.Adam(model.parameters(), lr=0.01)

def state():
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}

def locals_of(sd):
    return {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in sd["model"].items()} | {
        f"{k}.{n}": (t.to_local() if hasattr(t, "to_local") else t).clone()
        for k, per in sd["optim"]["state"].items() for n, t in per.items()}

snap = HostSnapshot(state, every=2, optimizer=optim, replicated=False)
if phase == "train":
    for step in range(1, 6):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
        snap.step(step)
        if step == 4:
            snap.wait()
            torch.save(locals_of(state()), f"{out}/expected-{rank}.pt")
    dist.barrier()
    os._exit(1)  # every rank dies: the slots stay
restored = snap.restore(like_state=state())
def report(line):  # one file per rank: two ranks' prints on one stdout can interleave
    with open(f"{out}/result-{world}-{rank}.txt", "w") as f:
        f.write(line)

if restored is None:
    report(f"rank {rank} of {world}: nothing restored")
    sys.exit(0)
set_state_dict(model, optim, model_state_dict=restored.state["model"], optim_state_dict=restored.state["optim"])
expected = torch.load(f"{out}/expected-{rank}.pt")
got = locals_of(state())
assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
assert all(torch.equal(got[k], expected[k]) for k in got), [k for k in got if not torch.equal(got[k], expected[k])]
kind = type(restored.state["model"]["0.weight"]).__name__
report(f"rank {rank} of {world}: restored step {restored.step} from {restored.source} as {kind}")
"""


def _run(tmp_path: Path, nproc: int, phase: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUWATCH_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), GPUWATCH_SNAPSHOT_ROOT=str(tmp_path / "shm"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", "localhost:0", "--rdzv-id", JOB, f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*command, str(script), phase, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )


def test_each_rank_reloads_its_own_shards_from_host_memory(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    trained = _run(tmp_path, 2, "train")
    assert trained.returncode != 0 and (tmp_path / "expected-1.pt").exists(), trained.stderr

    same_world = _run(tmp_path, 2, "restore")
    other_world = _run(tmp_path, 1, "restore")

    assert same_world.returncode == 0, same_world.stderr
    lines = [(tmp_path / f"result-2-{r}.txt").read_text() for r in (0, 1)]
    assert lines == [f"rank {r} of 2: restored step 4 from memory as DTensor" for r in (0, 1)]
    assert other_world.returncode == 0, other_world.stderr
    # another world holds other shards: the disk's job
    assert (tmp_path / "result-1-0.txt").read_text() == "rank 0 of 1: nothing restored"
