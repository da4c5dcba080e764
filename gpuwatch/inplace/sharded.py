"""ShardedJob: recovery in place for a job whose ranks each hold a shard (ZeroRedundancyOptimizer), and
for one-rank jobs.

No survivor holds a lost rank's shard, so the lost rank must be replaced (a warm spare,
gpuwatch.spares, takes its place within a second) and the job rolls back to the newest step that
every rank holds in host memory: each rank keeps its own state in a HostSnapshot every K steps (the
survivors their own slots, the replacement reads the lost rank's slot on this node), so nothing is
read from disk and at most K steps are redone. Everything else is InPlaceJob's: the survivors stay
in their processes (and keep their CUDA contexts), the generations, the new process group per
generation.

What differs from InPlaceJob:

* a rank keeps its shard's place: its rank in every group is its place in the job's first
  generation, ordered by (node, $RANK); a replacement started with the lost rank's $RANK (what the
  launcher gives it) takes that place;
* a generation that lacks a shard does not train: its members wait for the one that completes it;
* the state comes back from the host snapshots (`restore` callback), never from a peer;
* the snapshot in flight is committed before the optimizer updates the state, and a failure in the
  optimizer step (ZeRO's broadcast of the updated shards) rolls back too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.inplace.job import InPlaceJob, _first_line, _is_collective_failure, _is_cuda_fault
from gpuwatch.inplace.protocol import NODE_ENV, Generation, latest_generation, read_generation
from gpuwatch.snapshots import HostSnapshot
from gpuwatch.trainer.standby import wait_for_rank

T = TypeVar("T")
_WAIT_S = 0.005


class ShardedJob(InPlaceJob):
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
        others: passed to InPlaceJob (carried to joiners of a replicated job; unused here).
        **kwargs: InPlaceJob's other arguments (backend, collective_timeout_s, membership_timeout_s, ...).

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
        wait_for_rank()  # a standby (gpuwatch.spares) ran the script up to here and learns its rank now
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, not {every!r}")
        self._state_fn = state or self._default_state
        self._restore_fn = restore or self._default_restore
        self._every = every
        self._shard_key = f"{os.environ.get(NODE_ENV, '0')}:{os.environ.get('RANK', '0')}"
        self._shards: int | None = None
        self._snap: HostSnapshot | None = None
        self._updating = False
        super().__init__(model, cast(Any, optimizer), link, load=load, **kwargs)

    @property
    def snapshot(self) -> HostSnapshot | None:
        """This rank's host snapshot (None until the first generation formed)."""
        return self._snap

    def train_step(self, fn: Callable[[DistributedDataParallel], T]) -> T:
        """One step: the boundary, `fn(ddp)` (forward, backward), the optimizer step, the snapshot when due.

        A peer's failure anywhere in it (also in the optimizer step) rolls every rank back to the newest
        step all hold in host memory; `fn` then runs for that step again.
        """
        while True:
            before = time.monotonic()
            failure = None
            try:
                self._in_collective = True
                if self._pending is not None:
                    target, since = self._pending
                    self._pending = None
                    self._reform(target, since)
                agreed = self._boundary()
                if agreed > self.generation:
                    self._pending = (agreed, before)
                    continue
                assert self.ddp is not None and self._snap is not None
                result = fn(self.ddp)
                self._snap.wait()  # every rank past this point has committed its newest snapshot: at most K redone
                self._updating = True
                self.optimizer.step()
                self._settle()
                self._updating = False
            except TimeoutError:
                raise
            except Exception as exc:
                if not (_is_collective_failure(exc) or (self._aborted_for and not _is_cuda_fault(exc))):
                    raise
                failure = f"{type(exc).__name__}: {_first_line(exc)}"
            finally:
                self._in_collective = False
            if failure is None:
                break
            if self._updating:  # the update ran in part: this rank's state is no step's state any more
                self._updating, self._has_state = False, False
            self._after_failure(failure, before)
        self._step += 1
        self._snapshot().step(self._step)
        return result

    def close(self, *, remove: bool = True) -> None:
        """Stop the watcher, destroy the group, release the snapshot (`remove`: the job finished, delete it)."""
        super().close()
        if self._snap is not None:
            self._snap.close(remove=remove)

    # -- InPlaceJob's hooks -------------------------------------------------------------------------

    def _rendezvous(self, target: int) -> Generation:
        """InPlaceJob's rendezvous, but only a generation that holds every shard trains (or one without this rank)."""
        self._store.set(f"shard/{self.member}", self._shard_key)
        deadline = time.monotonic() + self._membership_timeout_s
        while True:
            generation = super()._rendezvous(target)
            if self.member not in generation.members or len(generation.members) >= self._shard_count():
                return generation
            while (target := latest_generation(self._store)) <= generation.number:  # a shard is missing: wait
                if time.monotonic() > deadline:
                    raise TimeoutError(f"generation {generation.number} lacks a shard and none came back")
                time.sleep(_WAIT_S)

    def _position(self, generation: Generation) -> int:
        keys = {m: _key(self._store.get(f"shard/{m}").decode()) for m in generation.members}
        return sorted(generation.members, key=lambda m: keys[m]).index(str(self.member))

    def _sync_state(self, generation: Generation) -> tuple[str, int]:
        """Every rank at the same step: held when all hold it, else the newest step all hold in host memory."""
        if not isinstance(self.optimizer, torch.optim.Optimizer):  # its factory: the group exists now
            self.optimizer = cast(Any, self.optimizer)()
        _rebind(self.optimizer)
        snap = self._snapshot()
        mine = self._step if self._has_state else -1
        steps = torch.tensor([mine, -mine], dtype=torch.int64, device=self._device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if int(steps[0]) == -int(steps[1]) >= 0:
            return "held", 0
        snap.wait()
        restored = snap.restore(device=self._device if self._device.type == "cuda" else None)  # straight onto the GPU
        if restored is not None:
            self._restore_fn(restored.state)
            self._step, self._has_state = restored.step, True
            return "memory", 0
        loaded = self._load() if self._load is not None else None  # every rank: its own shards (DCP)
        if loaded is None:  # a fresh start: every rank begins from rank 0's parameters (DDP does not sync them)
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, 0)
        self._step, self._has_state = loaded or 0, True
        snap.resumed_from(self._step)
        snap.snapshot_now(self._step)  # a base every rank holds from the start: a rollback always finds one
        return ("checkpoint" if loaded is not None else "fresh"), 0

    # -- helpers ------------------------------------------------------------------------------------

    def _default_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": _own_shard(self.optimizer).state_dict()}

    def _default_restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        _own_shard(self.optimizer).load_state_dict(state["optim"])

    def _shard_count(self) -> int:
        """The job's shards: the size of its first generation (read once)."""
        if self._shards is None:
            self._shards = len(read_generation(self._store, 1).members)
        return self._shards

    def _snapshot(self) -> HostSnapshot:
        if self._snap is None:
            optimizers = [o for o in (self.optimizer, getattr(self.optimizer, "optim", None)) if o is not None]
            self._snap = HostSnapshot(
                self._state_fn, every=self._every, optimizer=optimizers, replicated=False,
                rank=dist.get_rank(), world_size=self._shard_count(),
            )  # fmt: skip
        return self._snap


def _key(text: str) -> tuple[int, int]:
    node, _, rank = text.partition(":")
    return (int(node), int(rank)) if node.isdigit() and rank.isdigit() else (1 << 30, 0)


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
