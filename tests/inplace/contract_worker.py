"""One rank of the state-source contract (tests/inplace/test_state_sources.py), run as its own process.

    python -m tests.inplace.contract_worker SOURCE RANK WORLD STORE_FILE SNAPSHOT_ROOT

Runs a job shape's StateSource with no launcher around it (a FileStore, a process group per generation, as
the step engine forms them) through what the engine puts it through, and prints one JSON line: the
uninterrupted run's state digest per step, then the faulted run's. The faulted run: a fresh start, 4 steps,
a new group in which every rank holds its step ("held"), 2 more steps, then the last rank is lost (its
source dropped, a brand-new one in its place, as a spare's) while the others hold step 6; then on to 8.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from gpuwatch.examples.fsdp_worker import _build, shard_checksum
from gpuwatch.inplace.engine import Group, StateSource
from gpuwatch.inplace.fsdp import MeshRebuild
from gpuwatch.inplace.job import PeerBroadcast
from gpuwatch.inplace.sharded import SnapshotRollback

K = 3
WIDTH = 16


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def make_source(kind: str) -> StateSource:
    if kind == "peer":
        model = _mlp()
        return PeerBroadcast(model, torch.optim.Adam(model.parameters(), lr=0.01))
    if kind == "rollback":
        model = _mlp()
        return SnapshotRollback(
            model,
            lambda: ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01),
            every=K,
        )
    if kind == "fsdp":
        return MeshRebuild(lambda mesh, init: _build(mesh, init, WIDTH, 1, 1, torch.device("cpu")), every=K)
    raise ValueError(kind)


def digest(source: StateSource) -> str:
    """This rank's state: the whole model (replicated), or its own shards (FSDP)."""
    return shard_checksum(source.module.module if hasattr(source.module, "module") else source.module)


class Run:
    def __init__(self, kind: str, rank: int, world: int, store: Any, name: str) -> None:
        os.environ["GPUWATCH_JOB_ID"] = f"contract-{kind}-{name}"
        self.kind, self.rank, self.world, self.store, self.name = kind, rank, world, store, name
        self.source = make_source(kind)
        self.generation, self.step, self.held = 0, 0, False
        self.digests: dict[int, str] = {}
        self.origins: list[str] = []

    def form(self) -> None:
        if dist.is_initialized():
            self.source.unbind()
            dist.destroy_process_group()
        self.generation += 1
        prefix = dist.PrefixStore(f"{self.name}/pg/{self.generation}", self.store)
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", store=prefix, rank=self.rank, world_size=self.world, timeout=timeout)
        held = self.step if self.held else None
        synced = self.source.sync(Group(self.rank, self.world, self.world, held, torch.device("cpu")))
        self.step, self.held = synced.step, True
        self.origins.append(synced.origin)
        self.digests[self.step] = digest(self.source)

    def train(self, until: int) -> None:
        while self.step < until:
            g = torch.Generator().manual_seed(self.step * 1000 + self.rank)
            x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, 1, generator=g)
            module = self.source.module
            module.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(module(x), y).backward()
            self.source.before_update()
            self.source.update()
            self.step += 1
            self.source.after_step(self.step)
            self.digests[self.step] = digest(self.source)


def main() -> int:
    kind, rank, world, store_file, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ["GPUWATCH_SNAPSHOT_ROOT"] = root
    store = dist.FileStore(store_file, world)
    reference = Run(kind, rank, world, store, "reference")
    reference.form()
    reference.train(8)
    faulted = Run(kind, rank, world, store, "faulted")
    faulted.form()
    faulted.train(4)
    faulted.form()  # every rank holds step 4
    faulted.train(6)
    if rank == world - 1:  # lost: a new source in its place, holding nothing (the spare)
        lost = faulted.source
        faulted.source, faulted.held = make_source(kind), False
        lost.unbind()
    faulted.form()
    resumed = faulted.step
    faulted.train(8)
    dist.destroy_process_group()
    for run in (reference, faulted):
        run.source.close(finished=True)
    print(json.dumps({"reference": reference.digests, "faulted": faulted.digests, "resumed": resumed,
                      "origins": faulted.origins}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
