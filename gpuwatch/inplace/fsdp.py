"""FSDP2 and DTensor jobs in place: a device mesh and the model on it, built anew for each generation.

An FSDP2 (`fully_shard`) or tensor-parallel model is bound to the device mesh it was built on, and the
mesh to its process groups; a new generation's group needs a new mesh and a model bound to it. So the
job gives a function that builds the model and its optimizer on a mesh (`build(mesh)`), and for each
generation this source forms the mesh over the new group, calls `build`, and puts the state in:

* every rank held the same step (a rank left, a boundary): each moves its own shards from the old
  model into the new one, in its own memory (the same rank on a mesh of the same shape holds the same
  shards);
* a rank was lost (a spare took its place): every rank loads its own shards of the newest step all of
  them hold in host memory (`HostSnapshot(replicated=False)`: the survivors their own slots, the spare
  the lost rank's, on the same node), nothing from the disk; at most K steps are redone;
* nobody holds state (the job's first start): `load` (every rank its own shards, DCP), else `build`'s
  own initial state.

The state is `get_state_dict(model, optimizer)` (torch.distributed.checkpoint): DTensors whose local
shards the snapshot keeps, made DTensors on the new mesh again on the way in (`set_state_dict`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gpuwatch.inplace.engine import Group, StepEngine, Synced
from gpuwatch.inplace.protocol import Generation
from gpuwatch.inplace.reshard import read_every_rank, reshard
from gpuwatch.inplace.sharded import SnapshotSource, all_hold_one_step, rollback
from gpuwatch.snapshots import HostSnapshot
from gpuwatch.snapshots.restore import like, localize

__all__ = ["FSDPJob", "MeshRebuild"]
log = logging.getLogger("gpuwatch.inplace")

Build = Callable[[DeviceMesh, bool], tuple[torch.nn.Module, torch.optim.Optimizer]]


class MeshRebuild(SnapshotSource):
    """The state source of FSDP2 / DTensor jobs (see the module docstring).

    Args:
        build: `build(mesh, init)` builds the model on the mesh (`fully_shard`, `parallelize_module`) and its
            optimizer, once per generation. `init` False: the state is put in afterwards (held, or a host
            snapshot), so its values do not matter: build on the meta device and `to_empty` onto the rank's
            device. True (a fresh start): initialise it as at the job's start, the same on every rank (seeded).
        every: steps between host snapshots (K).
        mesh_shape, mesh_dim_names: the mesh (default: one dimension over every rank); its shape's product
            must be the world size.
        load: called on every rank when nobody holds state: loads its shards from the disk, returns the step or None.
        shrink: a 1-D job goes on with fewer ranks when one left (its GPU quarantined) and no replacement
            comes: the state is resharded from every rank's host snapshot (gpuwatch.inplace.reshard); when the
            GPU is released, the rank that joins grows it back the same way.
    """

    def __init__(
        self,
        build: Build,
        *,
        every: int,
        mesh_shape: Sequence[int] | None = None,
        mesh_dim_names: Sequence[str] | None = None,
        load: Callable[[torch.nn.Module, torch.optim.Optimizer], int | None] | None = None,
        shrink: bool = False,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, not {every!r}")
        if shrink and mesh_shape is not None and len(mesh_shape) > 1:
            raise ValueError("shrink: a mesh of several dimensions cannot shrink in place (its TP degree is fixed)")
        self._shrink_allowed = shrink
        self._build, self._every, self._load = build, every, load
        self._shape = tuple(mesh_shape) if mesh_shape is not None else None
        self._names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        self.mesh: DeviceMesh | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.snapshot: HostSnapshot | None = None
        self._held: dict[str, Any] | None = None  # the old model's local shards, between unbind and sync

    @property
    def module(self) -> torch.nn.Module:
        assert self.model is not None, "no group: the model is built once a generation formed"
        return self.model

    def state(self) -> dict[str, Any]:
        """This rank's state: the model's and the optimizer's state dicts (DTensors: this rank's shards)."""
        assert self.model is not None and self.optimizer is not None
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def sync(self, group: Group) -> Synced:
        shape = self._shape or (group.world_size,)
        self.mesh = init_device_mesh(group.device.type, shape, mesh_dim_names=self._names)
        if group.world_size != group.places:  # shrunk, or grown back after a shrink
            return self._reshard(group)
        snap = self._snapshot(group)
        held, self._held = self._held, None
        if all_hold_one_step(replace(group, held=group.held if held is not None else None)):
            assert held is not None and group.held is not None
            self._rebuild(held, init=False)
            return Synced(group.held, "held")
        restored = rollback(snap, group)
        del held  # the old model's shards: freed before the new model is built
        if restored is not None:
            self._rebuild(restored.state, init=False)
            return Synced(restored.step, "memory")
        self._rebuild(None, init=True)
        assert self.model is not None and self.optimizer is not None
        loaded = self._load(self.model, self.optimizer) if self._load is not None else None
        snap.resumed_from(loaded or 0)
        snap.snapshot_now(loaded or 0)  # a base every rank holds from the start: a rollback always finds one
        return Synced(loaded or 0, "checkpoint" if loaded is not None else "fresh")

    def unbind(self) -> None:
        """Keep this rank's local shards (views, no copy) and let go of the model, its optimizer and the mesh."""
        self._held = None
        if self.model is not None:
            try:
                self._held = localize(self.state())
            except Exception as exc:  # then this rank holds no step: the next generation rolls it back
                log.warning("the model's shards could not be kept: %s", exc)
        self.model = self.optimizer = self.mesh = None

    def before_update(self) -> None:
        """The snapshot in flight committed on every rank before any rank updates (at most K redone).

        FSDP2's update holds no collective, so a barrier of its own (one 8-byte all-reduce) stands in for it:
        without it a rank could complete a step past a peer's uncommitted snapshot (K + 1 redone).
        """
        super().before_update()
        assert self.model is not None
        dist.all_reduce(torch.zeros(1, device=next(self.model.parameters()).device))

    def may_train(self, generation: Generation, places: int) -> bool:
        """A full generation trains; with `shrink`, also one that a member left (quarantined) and none is gone."""
        full = len(generation.members) >= places
        return full or (self._shrink_allowed and bool(generation.left) and not generation.gone)

    def _reshard(self, group: Group) -> Synced:
        """Another world size than before: every old rank's shards of the newest common snapshot, re-split onto
        the new mesh (a rank that joins a shrunk job reads them as the others do)."""
        self._held = None
        old = self.snapshot
        new = HostSnapshot(
            self.state, every=self._every, replicated=False, rank=group.rank, world_size=group.world_size
        )  # fmt: skip
        found = read_every_rank(old or new, group.places, group.device)
        if old is not None:
            old.close(remove=False)
        self.snapshot = new
        if found is None:
            raise RuntimeError(f"no host snapshot all {group.places} old ranks hold: cannot reshard, relaunch")
        step, olds = found
        self._rebuild(None, init=False)
        template = self.state()
        local = reshard(olds, template, group.rank, group.world_size)
        del olds
        self._put(local, template)
        new.resumed_from(step)
        new.snapshot_now(step)  # the new world's first snapshot: a rollback finds one
        log.warning("resharded step %d from %d ranks onto %d", step, group.places, group.world_size)
        return Synced(step, "resharded")

    def _rebuild(self, local: dict[str, Any] | None, *, init: bool) -> None:
        """Build the model on the mesh and put `local` (this rank's shards of a state, or None) into it."""
        assert self.mesh is not None
        self.model, self.optimizer = self._build(self.mesh, init)
        if local is not None:
            self._put(local, self.state())  # the template: DTensors on the new mesh (the optimizer's initialised)

    def _put(self, local: dict[str, Any], template: dict[str, Any]) -> None:
        state = like(local, template)
        assert self.model is not None and self.optimizer is not None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def _snapshot(self, group: Group) -> HostSnapshot:
        if self.snapshot is None:  # no optimizer hook: it would hold the first generation's optimizer alive
            self.snapshot = HostSnapshot(
                self.state, every=self._every, replicated=False, rank=group.rank, world_size=group.world_size
            )
        return self.snapshot


class FSDPJob(StepEngine):
    """One rank of an FSDP2 / DTensor job that recovers in place: the step engine with a `MeshRebuild`.

        job = FSDPJob(build, link, every=10, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
        while job.step < total_steps:
            loss = job.train_step(forward_backward)    # forward_backward(model): job.optimizer, job.mesh
        job.close()

    Args: MeshRebuild's (build, every, mesh_shape, mesh_dim_names, load, shrink), the StepEngine's (link, backend,
    collective_timeout_s, membership_timeout_s, save).
    """

    def __init__(
        self,
        build: Build,
        link: Any = None,
        *,
        every: int,
        mesh_shape: Sequence[int] | None = None,
        mesh_dim_names: Sequence[str] | None = None,
        load: Callable[[torch.nn.Module, torch.optim.Optimizer], int | None] | None = None,
        shrink: bool = False,
        **kwargs: Any,
    ) -> None:
        self._mesh = MeshRebuild(
            build, every=every, mesh_shape=mesh_shape, mesh_dim_names=mesh_dim_names, load=load, shrink=shrink
        )
        super().__init__(self._mesh, link, **kwargs)

    @property
    def model(self) -> torch.nn.Module:
        """The current generation's model (a new object after each membership change)."""
        return self._mesh.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self._mesh.optimizer is not None
        return self._mesh.optimizer

    @property
    def mesh(self) -> DeviceMesh:
        assert self._mesh.mesh is not None
        return self._mesh.mesh

    @property
    def snapshot(self) -> HostSnapshot | None:
        return self._mesh.snapshot
