"""The state transfer over gloo, two real processes: a rank with nothing (a joiner) gets model, Adam
state, param_groups and a scheduler from the source, in chunks far smaller than the state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuwatch.testing.daemon_process import free_port
from tests.helpers import REPO

pytest.importorskip("torch")

RANK = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
from gpuwatch.inplace.transfer import checksum, send_state, state_tensors

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
torch.manual_seed(rank)  # different weights on each rank: the transfer must make them equal
model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Linear(300, 3))
model.register_buffer("seen", torch.tensor(rank * 7))
optim = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
if rank == 0:  # the source has trained: Adam moments, a 0-d step per parameter, a lowered lr
    for _ in range(5):
        model(torch.randn(4, 40)).sum().backward()
        optim.step()
        sched.step()
step, moved = send_state(model, optim, {"sched": sched}, 5 if rank == 0 else -1, 0, None, chunk_bytes=4096)
state = optim.state_dict()
print(json.dumps({
    "step": step, "moved": moved, "checksum": checksum(model), "lr": optim.param_groups[0]["lr"],
    "sched_epoch": sched.last_epoch, "adam": [float(t.double().sum()) for t in state_tensors(model, optim)],
}))
"""


@pytest.mark.slow
def test_a_rank_with_no_state_receives_the_whole_training_state_in_small_chunks() -> None:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.update(RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    source, joiner = outs
    assert joiner == source  # checksum, Adam state, lr, scheduler and step all equal
    assert joiner["step"] == 5 and joiner["lr"] == 0.0025 and joiner["sched_epoch"] == 5
    params = 40 * 300 + 300 + 300 * 3 + 3
    assert joiner["moved"] >= params * 4 * 3  # weights and both Adam moments, far more than one 4 KiB chunk


def test_the_header_is_data_that_round_trips_and_nothing_else_decodes() -> None:
    """What send_state's header carries comes back equal (tuples, int keys, layouts, NaN); a pickle-ish or
    unknown tag is a ValueError, and an object of a class is refused at the source."""
    from gpuwatch.inplace.transfer import _TensorLayout, decode, encode

    torch = pytest.importorskip("torch")
    header = {
        "step": 7,
        "optimizer": {"state": {0: {"exp_avg": _TensorLayout((3, 2), torch.float32)}}, "param_groups": [
            {"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None, "eps": float("inf")}
        ]},
        "others": {"sched": {"_last_lr": [0.05], "blob": b"\x00\xff", "t": torch.tensor([1.5, 2.0])}},
    }  # fmt: skip
    back = decode(json.loads(json.dumps(encode(header))))
    assert back["optimizer"] == header["optimizer"] and back["step"] == 7
    assert back["others"]["sched"]["blob"] == b"\x00\xff" and back["others"]["sched"]["t"].tolist() == [1.5, 2.0]
    for bad in ({"pickle": "gASV"}, {"layout": [[2], "system"]}, {"float": "1e999"}, {"a": 1, "b": 2}):
        with pytest.raises(ValueError):
            decode(bad)
    with pytest.raises(TypeError):
        encode({"x": object()})
