"""ShardedJob: recovery in place for a job whose ranks each hold a shard (ZeroRedundancyOptimizer), and
for one-rank jobs.

No survivor holds a lost rank's shard, so the lost rank must be replaced (a warm spare,
gpuwatch.spares, takes its place within a second) and the job rolls back to the newest step that
every rank holds in host memory: each rank keeps its own state in a HostSnapshot every K steps (the
survivors their own slots, the replacement reads the lost rank's slot on this node), so nothing is
read from disk and at most K steps are redone. Everything else is the step engine's
(gpuwatch.inplace.engine): the survivors stay in their processes (and keep their CUDA contexts), the
generations, the new process group per generation. The state source here, `SnapshotRollback`:

* a rank keeps its shard's place: its rank in every group is its place in the job's first
  generation, ordered by (node, $RANK); a replacement started with the lost rank's $RANK (what the
  launcher gives it) takes that place;
* a generation that lacks a shard does not train: its members wait for the one that completes it;
* the state comes back from the host snapshots (`restore` callback), never from a peer;
* the snapshot in flight is committed before the optimizer updates the state, and a failure in the
  optimizer step (ZeRO's broadcast of the updated shards) rolls back too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.inplace.engine import Group, StateSource, StepEngine, Synced
from gpuwatch.snapshots import HostSnapshot, Restored, pin_restore_buffers
from gpuwatch.trainer.standby import before_waiting

__all__ = ["ShardedJob", "SnapshotRollback", "SnapshotSource", "all_hold_one_step", "rollback"]

# _ONE_LAYOUT: a DistributedDataParallel reduces its first step's gradients in one bucket layout and, unless it
# looks for unused parameters, rebuilds its buckets after that step in the order the gradients became ready.
# Each generation wraps the model anew, so its first step would reduce in the first layout where an
# uninterrupted run uses the rebuilt one: with 3 or more ranks the all-reduce then adds in another order and the
# run drifts from an uninterrupted one by float32 rounding. With find_unused_parameters DDP never rebuilds: every
# generation reduces in the same layout (the parameters' buckets in reverse order, as overlapped as the rebuilt
# one for a model used in its definition's order), at the cost of one walk of the autograd graph per step.


def _pin_if_cuda() -> None:
    """A standby's join restores onto the GPU through pinned host buffers: pinned while it waits (0.4 s at 16 GiB),
    where its set-up made a CUDA context (one without may take a rank of any GPU: pinning would make one, bound)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pin_restore_buffers()


before_waiting(_pin_if_cuda)  # wherever the standby waits: the job object, or a held-back RANK read before it


def rollback(snap: HostSnapshot, group: Group) -> Restored | None:
    """The newest step all ranks of the group hold in host memory, read back (this rank's own shards), or None.

    All ranks call it when any holds no step (a replacement, a rank whose update ran in part): survivors
    and replacement alike go back to that step. On a GPU the state comes straight onto it.
    """
    snap.wait()
    return snap.restore(device=group.device if group.device.type == "cuda" else None)


def all_hold_one_step(group: Group) -> bool:
    """Whether every rank of the group holds the state of one same step (one MAX all-reduce)."""
    mine = group.held if group.held is not None else -1
    steps = torch.tensor([mine, -mine], dtype=torch.int64, device=group.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return int(steps[0]) == -int(steps[1]) >= 0


class SnapshotSource(StateSource):
    """A source whose lost ranks come back from host snapshots: the snapshot's part of the step, shared.

    Before each update the rank waits for its snapshot in flight to commit (the update must not overtake
    the copy, and at most K steps are redone); after each step the snapshot is started when due.
    """

    keeps_place = True
    snapshot: HostSnapshot | None = None
    optimizer: Any = None

    def before_update(self) -> None:
        assert self.snapshot is not None
        self.snapshot.wait()

    def update(self) -> None:
        cast(torch.optim.Optimizer, self.optimizer).step()

    def after_step(self, step: int) -> None:
        assert self.snapshot is not None
        self.snapshot.step(step)

    def close(self, *, finished: bool) -> None:
        if self.snapshot is not None:
            self.snapshot.close(remove=finished)


class SnapshotRollback(SnapshotSource):
    """Sharded state (ZeRO) or one rank: the host snapshot is where a lost rank's state comes back from.

    Args: as ShardedJob's (model, optimizer, every, state, restore, load).
    """

    collective_update = True  # ZeRO's update ends in a broadcast of the updated shards: no rank passes it before
    # every rank waited for its snapshot (before_update), so at most K steps are redone

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Callable[[], torch.optim.Optimizer],
        *,
        every: int,
        state: Callable[[], Any] | None = None,
        restore: Callable[[Any], object] | None = None,
        load: Callable[[], int | None] | None = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, not {every!r}")
        self.model, self.optimizer = model, optimizer
        self._state_fn = state or self._default_state
        self._restore_fn = restore or self._default_restore
        self._every, self._load = every, load
        self.snapshot: HostSnapshot | None = None
        self.ddp: DistributedDataParallel | None = None

    @property
    def module(self) -> DistributedDataParallel:
        assert self.ddp is not None, "no group: the module is wrapped once a generation formed"
        return self.ddp

    def sync(self, group: Group) -> Synced:
        """Every rank at the same step: held when all hold it, else the newest step all hold in host memory."""
        if not isinstance(self.optimizer, torch.optim.Optimizer):  # its factory: the group exists now
            self.optimizer = cast(Any, self.optimizer)()
        _rebind(self.optimizer)
        synced = self._bring_back(group)
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[group.device.index] if group.device.type == "cuda" else None, init_sync=False,
            find_unused_parameters=True,  # one bucket layout for good: see _ONE_LAYOUT
        )  # fmt: skip
        return synced

    def before_group(self, group: Group) -> None:
        """This rank will restore: its newest slot is read onto the GPU while the group forms (a ZeRO optimizer made
        by a factory exists only in sync, and with it the snapshot: no read ahead then)."""
        if group.device.type == "cuda" and isinstance(self.optimizer, torch.optim.Optimizer):
            self._snapshot(group).prefetch(group.device)

    def _bring_back(self, group: Group) -> Synced:
        snap = self._snapshot(group)
        if all_hold_one_step(group):
            assert group.held is not None
            return Synced(group.held, "held")
        restored = rollback(snap, group)
        if restored is not None:
            self._restore_fn(restored.state)
            return Synced(restored.step, "memory")
        loaded = self._load() if self._load is not None else None  # every rank: its own shards (DCP)
        if loaded is None:  # a fresh start: every rank begins from rank 0's parameters (DDP does not sync them)
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, 0)
        snap.resumed_from(loaded or 0)
        snap.snapshot_now(loaded or 0)  # a base every rank holds from the start: a rollback always finds one
        return Synced(loaded or 0, "checkpoint" if loaded is not None else "fresh")

    def unbind(self) -> None:
        self.ddp = None

    def _default_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": _own_shard(self.optimizer).state_dict()}

    def _default_restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        _own_shard(self.optimizer).load_state_dict(state["optim"])

    def _snapshot(self, group: Group) -> HostSnapshot:
        if self.snapshot is None:
            optimizers = [o for o in (self.optimizer, getattr(self.optimizer, "optim", None)) if o is not None]
            self.snapshot = HostSnapshot(
                self._state_fn, every=self._every, optimizer=optimizers, replicated=False,
                rank=group.rank, world_size=group.places,
            )  # fmt: skip
        return self.snapshot


class ShardedJob(StepEngine):
    """One rank of a sharded (or one-rank) job that recovers in place from host snapshots.

    Args:
        model: the module (not wrapped); each generation wraps it in DistributedDataParallel.
        optimizer: its optimizer, or a function that makes it once the job's first group exists (a
            ZeroRedundancyOptimizer needs one); a ZeroRedundancyOptimizer is rebound to each new group.
        link: the rank's TrainerLink, as for InPlaceJob.
        every: steps between snapshots (K): a lost rank costs at most K steps redone.
        state: returns this rank's state to snapshot; default `{"model": model.state_dict(), "optim":
            <the optimizer's own shard>.state_dict()}` (a ZeroRedundancyOptimizer's shard is its `.optim`).
            May be called before the constructor returns.
        restore: loads a state of that shape back (default: into the model and the optimizer's shard).
        load: called on every rank when no host snapshot exists (the job's first start): loads this
            rank's shards from the disk (DCP), returns the step or None.
        **kwargs: the StepEngine's other arguments (backend, collective_timeout_s, membership_timeout_s, save).

    Raises:
        NotInPlace: not under `gpuwatch launch --in-place`.
        ValueError: every is not a positive integer.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Callable[[], torch.optim.Optimizer],
        link: Any = None,
        *,
        every: int,
        state: Callable[[], Any] | None = None,
        restore: Callable[[Any], object] | None = None,
        load: Callable[[], int | None] | None = None,
        **kwargs: Any,
    ) -> None:
        self._rollback = SnapshotRollback(model, optimizer, every=every, state=state, restore=restore, load=load)
        self.model = model
        super().__init__(self._rollback, link, **kwargs)

    @property
    def optimizer(self) -> Any:
        """The optimizer (made by the factory once the first group formed)."""
        return self._rollback.optimizer

    @property
    def ddp(self) -> DistributedDataParallel | None:
        return self._rollback.ddp

    @property
    def snapshot(self) -> HostSnapshot | None:
        """This rank's host snapshot (None until the first generation formed)."""
        return self._rollback.snapshot

    def close(self, *, remove: bool = True, finished: bool | None = None) -> None:
        """Stop the watcher, destroy the group, release the snapshot (`remove`: the job finished, delete it)."""
        super().close(finished=remove if finished is None else finished)


def _own_shard(optimizer: Any) -> Any:
    """The optimizer that holds this rank's own state: a ZeroRedundancyOptimizer's local one, else itself."""
    return getattr(optimizer, "optim", optimizer)


def _rebind(optimizer: Any) -> None:
    """A ZeroRedundancyOptimizer keeps the group it was made in: point it at the new default group.

    The shard's rank and the world size stay (a rank keeps its place), so its partition stays valid.
    """
    if hasattr(optimizer, "process_group") and hasattr(optimizer, "global_rank"):
        group = dist.group.WORLD
        optimizer.process_group = group
        optimizer.rank = dist.get_rank(group)
        optimizer.global_rank = dist.get_rank()
        optimizer.world_size = dist.get_world_size(group)
