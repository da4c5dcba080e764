"""InPlaceJob: a DDP rank that survives its peers' faults and takes in new peers, in the same process.

The step engine (gpuwatch.inplace.engine) runs the loop and the generations; what is DDP's is the
state source here, `PeerBroadcast`: each generation wraps the same module in a new
DistributedDataParallel, so nothing of the state moves when a peer leaves. When a peer fails the
survivors form the next generation and run the same step again from the state they hold: same
process, no step lost, no checkpoint read. Joiners (a released GPU, a replacement) and any rank a step
behind get the state from the lowest rank that holds the newest step, by chunked broadcast
(gpuwatch.inplace.transfer). Only a generation in which nobody holds state (the first, or after every
holder died) loads, through the `load` callback, on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.inplace.engine import Change, Group, NotInPlace, StateSource, StepEngine, Synced, leaves
from gpuwatch.inplace.transfer import DEFAULT_CHUNK_BYTES, Stateful, send_state
from gpuwatch.trainer.link import TrainerLink

__all__ = ["Change", "InPlaceJob", "NotInPlace", "PeerBroadcast", "leaves"]


class PeerBroadcast(StateSource):
    """Replicated state (DDP): a rank that lacks the newest step gets it from the lowest rank that holds it.

    Args:
        model: the module (not wrapped); `ddp` is the DistributedDataParallel of the current group.
        optimizer: its optimizer.
        load: called on rank 0 when no rank holds state: loads the newest checkpoint, returns its step or None.
        others: small state to carry to joiners (name -> object with state_dict/load_state_dict).
        chunk_bytes: the most bytes one broadcast of a state transfer carries.
        ddp_kwargs: more DistributedDataParallel arguments (init_sync is always False: the state is synced here).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        load: Callable[[], int | None] | None = None,
        others: dict[str, Stateful] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self._load, self._others, self._chunk_bytes = load, dict(others or {}), chunk_bytes
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self.ddp: DistributedDataParallel | None = None

    @property
    def module(self) -> DistributedDataParallel:
        assert self.ddp is not None, "no group: the module is wrapped once a generation formed"
        return self.ddp

    def sync(self, group: Group) -> Synced:
        mine = group.held if group.held is not None else -1
        steps = torch.tensor([mine, -mine], dtype=torch.int64, device=group.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        newest, oldest = int(steps[0]), -int(steps[1])
        if newest < 0:  # nobody holds state: rank 0 loads (or starts anew), the others get it from rank 0
            loaded = self._load() if group.rank == 0 and self._load is not None else None
            step, moved = self._send(loaded or 0, 0)
            origin = "checkpoint" if group.rank == 0 and loaded is not None else "fresh" if group.rank == 0 else "peer"
        elif newest == oldest:
            step, moved, origin = newest, 0, "held"
        else:
            holder = torch.tensor([group.rank if mine == newest else group.world_size], device=group.device)
            dist.all_reduce(holder, op=dist.ReduceOp.MIN)
            step, moved = self._send(mine, int(holder.item()))
            origin = "held" if mine == newest else "peer"
        self.ddp = DistributedDataParallel(
            self.model,
            device_ids=[group.device.index] if group.device.type == "cuda" else None,
            init_sync=False,
            **self._ddp_kwargs,
        )
        return Synced(step, origin, moved)

    def _send(self, step: int, source: int) -> tuple[int, int]:
        return send_state(self.model, self.optimizer, self._others, step, source, None, self._chunk_bytes)

    def unbind(self) -> None:
        self.ddp = None

    def update(self) -> None:
        self.optimizer.step()


class InPlaceJob(StepEngine):
    """One rank of a data-parallel job that recovers in place: the step engine with a `PeerBroadcast`.

    Args:
        model: the module (not wrapped); `ddp` is the DistributedDataParallel of the current generation.
        optimizer: its optimizer; stepped by `train_step` after `fn` succeeded.
        link: the rank's TrainerLink (StepEngine).
        load: called on rank 0 when no member holds state (the first generation, or after every
            holder died): loads the newest checkpoint into model and optimizer, returns its step or None.
        save: called with the step when this rank leaves and no member is left to hold the state.
        others, chunk_bytes, ddp_kwargs: PeerBroadcast's.
        backend, collective_timeout_s, membership_timeout_s: StepEngine's.

    Raises: as StepEngine.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        link: TrainerLink | None = None,
        *,
        load: Callable[[], int | None] | None = None,
        save: Callable[[int], object] | None = None,
        others: dict[str, Stateful] | None = None,
        backend: str | None = None,
        collective_timeout_s: float = 30.0,
        membership_timeout_s: float = 600.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        source = PeerBroadcast(
            model, optimizer, load=load, others=others, chunk_bytes=chunk_bytes, ddp_kwargs=ddp_kwargs
        )
        super().__init__(
            source, link, save=save, backend=backend, collective_timeout_s=collective_timeout_s,
            membership_timeout_s=membership_timeout_s,
        )  # fmt: skip

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The DistributedDataParallel of the current generation (None between generations)."""
        source = self.source
        assert isinstance(source, PeerBroadcast)
        return source.ddp
