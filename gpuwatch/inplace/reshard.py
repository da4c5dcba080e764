"""Reshard an FSDP2 job's host snapshots onto another world size: every old rank's state, re-split.

When a rank left for good (its GPU quarantined, no GPU to put a replacement on), a 1-D FSDP2 job may go on
with fewer ranks, and grow back when the GPU is released. Every new rank reads the slots of every old
rank at the newest step all of them hold (on this node, verified), puts each `Shard(0)` DTensor's full
tensor back together (the old ranks' local shards in rank order along dim 0) and keeps its own chunk of
it on the new mesh, as FSDP2 and DCP split a tensor (`torch.chunk` along dim 0; a rank past the last
chunk holds an empty one). Replicated values and everything else (the optimizer's `step`, its
param_groups) come from old rank 0.

What it costs: each new rank reads the whole state, not its shard (the old world's slots, from /dev/shm),
and holds the whole state in host memory while it takes its chunk.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from gpuwatch.snapshots import HostSnapshot
from gpuwatch.snapshots.restore import candidates, read_state

log = logging.getLogger("gpuwatch.inplace")


def read_every_rank(snap: HostSnapshot, old_world: int, device: torch.device) -> tuple[int, list[Any]] | None:
    """The newest step every one of the old world's ranks holds in this node's snapshots, and each one's state.

    Collective over the new group: every rank's snapshot in flight is committed before any rank lists the
    slots, and all agree on the step (MIN). None when some old rank has no slot left.
    """
    snap.wait()
    dist.barrier()
    fd = os.open(snap.directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        per_rank = [candidates(fd, rank=r, world_size=old_world, replicated=False) for r in range(old_world)]
        common = set.intersection(*({c.header.step for c in found} for found in per_rank))
        step = torch.tensor([max(common) if common else -1], dtype=torch.int64, device=device)
        dist.all_reduce(step, op=dist.ReduceOp.MIN)
        agreed = int(step.item())
        if agreed < 0:
            return None
        states = []
        for found in per_rank:
            state, why = read_state(fd, next(c for c in found if c.header.step == agreed))
            if state is None:
                raise RuntimeError(f"a host snapshot of step {agreed} did not verify: {why}")
            states.append(state)
        return agreed, states
    finally:
        os.close(fd)


def reshard(olds: list[Any], template: Any, rank: int, world: int) -> Any:
    """This rank's local shards of the new mesh, from the old ranks' local shards (`template`: the new state)."""
    if _is_sharded_dtensor(template):
        full = torch.cat(list(olds), dim=0)
        chunks = list(torch.chunk(full, world, dim=0))
        return chunks[rank].clone() if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    if isinstance(template, dict):
        return {k: reshard([o[k] for o in olds], v, rank, world) for k, v in template.items()}
    if isinstance(template, list | tuple) and not isinstance(template, str):
        return type(template)(reshard([o[i] for o in olds], v, rank, world) for i, v in enumerate(template))
    return olds[0]


def _is_sharded_dtensor(value: Any) -> bool:
    placements = getattr(value, "placements", None)
    if not placements or not hasattr(value, "to_local"):
        return False
    if len(placements) == 1 and placements[0].is_replicate():
        return False
    if len(placements) != 1 or not placements[0].is_shard() or placements[0].dim != 0:
        raise ValueError(f"only a 1-D mesh sharded on dim 0 reshards in place, not {placements}: relaunch")
    return True
