"""InPlaceJob: a DDP rank that survives its peers' faults and takes in new peers, in the same process.

Under `gpuwatch launch --in-place` every worker is one member of the job; the membership comes in
generations that the launcher hosting the job's store publishes (gpuwatch.inplace.coordinator).
Each generation has its own process group (the default group, created anew under the store
prefix `pg/<g>/`) and its own DistributedDataParallel wrapper around the same module, so nothing of
the state moves when a peer leaves. A step, `train_step(fn)`, is:

1. the boundary: one MAX all-reduce of the newest generation each rank has seen (a watcher thread
   reads the store every 20 ms), so all ranks switch at the same step; a rank whose GPU is
   quarantined asks to leave here and goes on stepping until the others have switched;
2. `fn(ddp)`: the forward and backward passes, whose DDP all-reduce is the step's collective; it
   must not change the state (the optimizer step comes after it);
3. `optimizer.step()`.

When 1 or 2 fails because a peer is gone (gloo raises at once when a peer's process is gone; NCCL
is aborted by the watcher thread once the launcher published the peer's exit), the rank reports the
failure, waits for the generation without that peer, forms it and runs the same step again from
the state it holds: same process, no step lost, no checkpoint read. Joiners (a released GPU, a
replacement) and any rank a step behind get the state from the lowest rank that holds the newest
step, by chunked broadcast (gpuwatch.inplace.transfer). Only a generation in which nobody holds
state (the first, or after every holder died) loads, through the `load` callback, on rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.inplace.jobstore import JobStore
from gpuwatch.inplace.protocol import (
    DONE,
    FAILED,
    JOB_ENV,
    JOIN,
    LEAVE,
    MEMBER_ENV,
    NODE_ENV,
    STORE_ENV,
    Generation,
    append_event,
    job_prefix,
    latest_generation,
    read_generation,
)
from gpuwatch.inplace.secret import SECRET_FILE_ENV, read_secret
from gpuwatch.inplace.sockets import shut_down, socket_inodes
from gpuwatch.inplace.transfer import DEFAULT_CHUNK_BYTES, Stateful, send_state
from gpuwatch.trainer.contract import (
    DEFAULT_RUNTIME_DIR,
    RECOVERY_IN_PLACE,
    RUNTIME_DIR_ENV,
    STATUS_FILE,
    quarantined_in,
)
from gpuwatch.trainer.link import TrainerLink
from gpuwatch.trainer.standby import wait_for_rank

log = logging.getLogger("gpuwatch.inplace")
T = TypeVar("T")

_WATCH_S = 0.02  # how often the watcher reads the newest generation
_PARTS = ("before", "rendezvous", "group", "state", "ddp")  # a membership change's parts (Change.parts)
_STATUS_S = 0.25  # how often it looks at status.json's mtime
_CUDA_FAULT_WORDS = ("cuda error", "illegal memory access", "cublas_status", "cudnn_status", "ecc error", "xid")
_COLLECTIVE_WORDS = ("gloo", "nccl", "connection", "process group", "processgroup", "timed out", "aborted", "peer")


class NotInPlace(RuntimeError):
    """The process was not started by `gpuwatch launch --in-place` (its store and member id are missing)."""


@dataclass(frozen=True)
class Change:
    """The last membership change this rank went through, for the job's own log."""

    generation: int
    reason: str
    source: str  # "held" (this rank kept its state), "peer" (received it), "checkpoint", "fresh"
    seconds: float  # from the failure, the boundary or the start to the new group's first step
    moved_bytes: int
    parts: dict[str, float] = field(default_factory=dict)  # where `seconds` went: before, rendezvous, group, state, ddp


class InPlaceJob:
    """One rank of a data-parallel job that recovers in place (see the module docstring).

    Args:
        model: the module (not wrapped); `ddp` is the DistributedDataParallel of the current generation.
        optimizer: its optimizer; stepped by `train_step` after `fn` succeeded.
        link: the rank's TrainerLink: told `recovery = "in_place"`, its stop request (a quarantine of
            this rank's GPU) makes the rank leave, and it is closed with exit 75 when it has left.
        load: called on rank 0 when no member holds state (the first generation, or after every
            holder died): loads the newest checkpoint into model and optimizer, returns its step or None.
        save: called with the step when this rank leaves and no member is left to hold the state.
        others: small state to carry to joiners (name -> object with state_dict/load_state_dict).
        backend: "nccl" or "gloo"; default nccl when CUDA is there.
        collective_timeout_s: the process groups' timeout (gloo's only way out of a hung peer).
        membership_timeout_s: how long a rank waits for a new generation before it gives up.
        chunk_bytes: the most bytes one broadcast of a state transfer carries.
        ddp_kwargs: more DistributedDataParallel arguments (init_sync is always False: the state is synced here).

    Raises:
        NotInPlace: GPUWATCH_INPLACE_STORE, GPUWATCH_INPLACE_MEMBER or GPUWATCH_INPLACE_SECRET_FILE is not set.
        SecretError: the secret file is not this user's own private file.
        TimeoutError: no generation with this rank formed within membership_timeout_s.
        SystemExit: 0 when the job's work was done before this rank was taken in (a late replacement).
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
        wait_for_rank()  # a standby (gpuwatch.spares) ran the script up to here and learns its rank now
        address, self.member = os.environ.get(STORE_ENV), os.environ.get(MEMBER_ENV)
        secret_file = os.environ.get(SECRET_FILE_ENV)
        if not address or not self.member or not secret_file:
            raise NotInPlace(
                f"{STORE_ENV}, {MEMBER_ENV} and {SECRET_FILE_ENV} are not set:"
                " run the job under `gpuwatch launch --in-place`"
            )
        host, _, port = address.rpartition(":")
        prefix = job_prefix(os.environ.get(JOB_ENV, "job"))
        secret = read_secret(secret_file)
        # Kept here: a Python store that only torch holds loses its methods (torch calls a pure virtual).
        self._connections = [_connect(host, int(port), secret, membership_timeout_s) for _ in range(2)]
        self._store = dist.PrefixStore(prefix, self._connections[0])
        self._watch_store = dist.PrefixStore(prefix, self._connections[1])
        self.model, self.optimizer, self._link = model, optimizer, link
        self._load, self._save, self._others = load, save, dict(others or {})
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self._timeout = datetime.timedelta(seconds=collective_timeout_s)
        self._membership_timeout_s = membership_timeout_s
        self._chunk_bytes = chunk_bytes
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._step = 0
        self._has_state = False
        self._gen: Generation | None = None
        self._latest = 0
        self._leave_sent = False
        self._quarantined = False
        self._in_collective = False
        self._aborted_for = 0
        self._group_sockets: dict[int, int] = {}  # fd -> inode of the current gloo group's connections
        self._pending: tuple[int, float] | None = None  # (generation, since): to form at the next step's start
        self._gpu_uuid = link.gpu_uuid if link is not None else _visible_uuid()
        runtime_dir = (
            link.runtime_dir if link is not None else Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
        )
        self._status_path = Path(runtime_dir) / STATUS_FILE
        self._status_key: tuple[int, int] | None = None
        self.ddp: DistributedDataParallel | None = None
        self.last_change: Change | None = None
        if link is not None:
            link.recovery = RECOVERY_IN_PLACE
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="gpuwatch-inplace-watch", daemon=True)
        self._watcher.start()
        started = time.monotonic()
        append_event(self._store, JOIN, member=self.member, node=int(os.environ.get(NODE_ENV, "0")))
        self._reform(self._first_generation_with_me(), since=started)

    # -- what the training loop reads -----------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps completed: the next step to take is this one (0-based)."""
        return self._step

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def generation(self) -> int:
        return self._gen.number if self._gen is not None else 0

    def train_step(self, fn: Callable[[DistributedDataParallel], T]) -> T:
        """Take one step: agree on the membership, run `fn(ddp)` (forward, backward), step the optimizer.

        `fn` reads `rank` and `world_size` for its share of the global batch and must leave the
        state alone (gradients only): when a peer fails during it, it is run again in the new
        generation from the same state.

        Raises:
            SystemExit: 75 when this rank's GPU is quarantined and the others have left it.
            Exception: fn's own error when it is no collective failure.
        """
        while True:
            before = time.monotonic()
            failure = None
            try:
                self._in_collective = True
                if self._pending is not None:  # a new generation to form (after a failure or at a boundary)
                    target, since = self._pending
                    self._pending = None
                    self._reform(target, since)
                agreed = self._boundary()
                if agreed > self.generation:
                    self._pending = (agreed, before)
                    continue
                assert self.ddp is not None
                result = fn(self.ddp)
                self._settle()
            except TimeoutError:
                raise  # no membership formed in membership_timeout_s: nothing left to wait for
            except Exception as exc:
                if not (_is_collective_failure(exc) or (self._aborted_for and not _is_cuda_fault(exc))):
                    raise
                failure = f"{type(exc).__name__}: {_first_line(exc)}"  # not exc: its frames hold the old group
            finally:
                self._in_collective = False
            if failure is None:
                break
            self._after_failure(failure, before)
        self.optimizer.step()
        self._step += 1
        return result

    def _settle(self) -> None:
        """Make sure the step's collectives really ended before the state changes.

        An aborted NCCL collective may return instead of raising, leaving garbage in the gradients;
        and DDP's all-reduce may still be running on the GPU when fn returns. So on NCCL, wait for
        the stream, then treat an abort during the step as the failure it is.
        """
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        if self._aborted_for:
            raise RuntimeError(f"the process group was aborted during the step (generation {self._aborted_for})")

    def close(self) -> None:
        """Stop the watcher and destroy the process group (idempotent)."""
        self._closed.set()
        self._destroy_group()

    # -- generations ----------------------------------------------------------------------------

    def _boundary(self) -> int:
        """The newest generation any rank has seen (one MAX all-reduce); asks to leave first when due."""
        if not self._leave_sent and self._wants_leave():
            self._leave_sent = True
            reason = "status.json quarantines its GPU" if self._quarantined else (self._link and self._link.stop_reason)
            log.warning("member %s (rank %d) leaves the job: %s", self.member, self.rank, reason)
            append_event(self._store, LEAVE, member=self.member)
        seen = torch.tensor([max(self._latest, self.generation)], dtype=torch.int64, device=self._device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        agreed = int(seen.item())
        if self._aborted_for:  # the aborted all-reduce returned: its value means nothing
            raise RuntimeError(f"the process group was aborted at the boundary (generation {self._aborted_for})")
        return agreed

    def _after_failure(self, failure: str, since: float) -> None:
        """A collective failed: close the group at once, say so, wait for the next generation (formed next).

        Closing first matters: a survivor may be blocked receiving from this rank (alive, so gloo
        sees no error) rather than from the dead one. gloo has no abort (torch 2.13), and its
        connections close only when the last reference to the group goes (DDP's hooks on the
        module's parameters keep one), so this rank shuts down the group's own sockets: a peer
        waiting on it gets "connection closed" at once.
        """
        failed_in = self.generation
        log.warning("member %s: collective failed in generation %d: %s", self.member, failed_in, failure)
        shut_down(self._group_sockets)
        self._destroy_group()
        append_event(self._store, FAILED, member=self.member, gen=failed_in)
        deadline = time.monotonic() + self._membership_timeout_s
        while latest_generation(self._store) <= failed_in:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new generation after generation {failed_in} failed: {failure}")
            time.sleep(_WATCH_S / 4)
        self._pending = (latest_generation(self._store), since)

    def _first_generation_with_me(self) -> int:
        deadline = time.monotonic() + self._membership_timeout_s
        while True:
            latest = latest_generation(self._store)
            if latest and self.member in read_generation(self._store, latest).members:
                return latest
            self._end_if_done(f"before member {self.member} was taken in")
            if time.monotonic() > deadline:
                raise TimeoutError(f"member {self.member}: no generation took it in")
            time.sleep(_WATCH_S)

    def _reform(self, target: int, since: float) -> None:
        """Leave the old group, meet the members of the newest generation, form its group, sync the state."""
        self._destroy_group()
        marks = [time.monotonic()]
        generation = self._rendezvous(target)
        if self.member not in generation.members:
            self._leave(generation)
        marks.append(time.monotonic())
        rank, world = self._position(generation), len(generation.members)
        sockets_before = socket_inodes()
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"pg/{generation.number}", self._store),
            rank=rank,
            world_size=world,
            timeout=self._timeout,
        )
        self._group_sockets = {fd: ino for fd, ino in socket_inodes().items() if sockets_before.get(fd) != ino}
        self._gen = generation
        self._aborted_for = 0
        marks.append(time.monotonic())
        source, moved = self._sync_state(generation)
        marks.append(time.monotonic())
        self.ddp = DistributedDataParallel(
            self.model,
            device_ids=[self._device.index] if self._device.type == "cuda" else None,
            init_sync=False,
            **self._ddp_kwargs,
        )
        if self._link is not None:
            self._link.rank, self._link.world_size = rank, world
        marks.append(time.monotonic())
        spans = [marks[0] - since, *(b - a for a, b in zip(marks, marks[1:], strict=False))]
        parts = {name: round(s, 4) for name, s in zip(_PARTS, spans, strict=True)}
        self.last_change = Change(generation.number, generation.reason, source, time.monotonic() - since, moved, parts)
        log.debug("member %s: generation %d: %s", self.member, generation.number, parts)
        log.info(
            "member %s: generation %d (%s): rank %d of %d, state %s, %.2f s",
            self.member, generation.number, generation.reason, rank, world, source, self.last_change.seconds,
        )  # fmt: skip

    def _position(self, generation: Generation) -> int:
        """This rank in the generation's group: its place among the members (a sharded job keeps its shard's)."""
        return generation.members.index(self.member)

    def _rendezvous(self, target: int) -> Generation:
        """Wait until every member of the newest generation (from `target` on) is here; that generation."""
        deadline = time.monotonic() + self._membership_timeout_s
        number = target
        generation = read_generation(self._store, number)
        self._store.set(f"ready/{number}/{self.member}", "1")
        while True:
            latest = latest_generation(self._store)
            if latest > number:
                number, generation = latest, read_generation(self._store, latest)
                self._store.set(f"ready/{number}/{self.member}", "1")
            if self.member not in generation.members:
                return generation
            if self._store.check([f"ready/{number}/{m}" for m in generation.members]):
                return generation
            if not self._has_state:  # a joiner whose generation's members finished meanwhile
                self._end_if_done(f"while member {self.member} waited to join generation {number}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {number}: not every member arrived: {generation.members}")
            time.sleep(_WATCH_S / 4)

    def _end_if_done(self, when: str) -> None:
        """A member finished: no generation comes any more, so this rank, which holds nothing, ends with 0."""
        if self._store.check([DONE]):
            log.warning("member %s: the job's work was done %s: nothing left for it", self.member, when)
            self.close()
            raise SystemExit(0)

    def _sync_state(self, generation: Generation) -> tuple[str, int]:
        """Make every rank hold the newest step's state; how this rank got its state, and the bytes moved."""
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = self._step if self._has_state else -1
        steps = torch.tensor([mine, -mine], dtype=torch.int64, device=self._device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        newest, oldest = int(steps[0]), -int(steps[1])
        if newest < 0:  # nobody holds state: rank 0 loads (or starts anew), the others get it from rank 0
            loaded = self._load() if rank == 0 and self._load is not None else None
            self._step = loaded or 0
            self._step, moved = send_state(
                self.model, self.optimizer, self._others, self._step, 0, None, self._chunk_bytes
            )
            self._has_state = True
            origin = "checkpoint" if rank == 0 and loaded is not None else "fresh" if rank == 0 else "peer"
            return origin, moved
        if newest == oldest:
            return "held", 0
        holder = torch.tensor([rank if mine == newest else world], dtype=torch.int64, device=self._device)
        dist.all_reduce(holder, op=dist.ReduceOp.MIN)
        source = int(holder.item())
        self._step, moved = send_state(
            self.model, self.optimizer, self._others, self._step, source, None, self._chunk_bytes
        )
        had = mine == newest
        self._has_state = True
        return ("held" if had else "peer"), moved

    def _leave(self, generation: Generation) -> None:
        """This rank is not in the new generation: it left (quarantine) or was taken for gone."""
        if not self._leave_sent:
            raise RuntimeError(f"member {self.member} was dropped from generation {generation.number}")
        self._closed.set()
        if not generation.members and self._save is not None and self._has_state:
            log.warning("member %s: no member is left to hold the state: saving step %d", self.member, self._step)
            self._save(self._step)
        why = f"left in place at step {self._step}; generation {generation.number} goes on without it"
        log.warning("member %s: %s", self.member, why)
        if self._link is not None:
            self._link.exit_for_resume(why)
        raise SystemExit(75)

    def _destroy_group(self) -> None:
        self.ddp = None
        self._gen = None  # the watcher aborts only a group that exists
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a group whose peer is gone may fail to shut down cleanly
                dist.destroy_process_group()

    # -- the watcher thread ---------------------------------------------------------------------

    def _wants_leave(self) -> bool:
        link = self._link
        reason = link.stop_reason if link is not None and link.stop_requested else None
        if reason is not None and not self._quarantined:
            self._check_status()  # the daemon writes status.json before it signals: read it now, not at the next poll
        return leaves(reason, quarantined=self._quarantined, status_file=self._status_path.exists())

    def _watch(self) -> None:
        next_status = 0.0
        while not self._closed.wait(_WATCH_S):
            try:
                latest = latest_generation(self._watch_store)
                if latest != self._latest:
                    self._latest = latest
                    self._abort_if_peer_gone(latest)
                if time.monotonic() >= next_status:
                    next_status = time.monotonic() + _STATUS_S
                    self._check_status()
            except Exception as exc:  # the store may be gone at the job's end; training goes on
                log.debug("in-place watcher: %s", exc)

    def _abort_if_peer_gone(self, latest: int) -> None:
        """NCCL waits for a dead peer: abort the group so the main thread's collective fails (gloo fails by itself)."""
        current = self._gen
        if current is None or self.backend != "nccl" or not self._in_collective or latest <= current.number:
            return
        newest = read_generation(self._watch_store, latest)
        if not set(newest.gone) & set(current.members):
            return
        self._aborted_for = latest
        log.warning("member %s: a peer is gone (generation %d): aborting the NCCL group", self.member, latest)
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()

    def _check_status(self) -> None:
        if self._gpu_uuid is None or self._quarantined:
            return
        try:
            st = self._status_path.stat()
            key = (st.st_mtime_ns, st.st_ino)
            if key == self._status_key:
                return
            self._status_key = key
            status = json.loads(self._status_path.read_bytes())
        except (OSError, ValueError):
            return
        self._quarantined = quarantined_in(status, self._gpu_uuid)


def leaves(stop_reason: str | None, *, quarantined: bool, status_file: bool) -> bool:
    """Whether a rank leaves the job: its own GPU is quarantined; a stop signal about another GPU is not its.

    Args:
        stop_reason: TrainerLink.stop_reason when a stop was requested, else None.
        quarantined: status.json quarantines this rank's GPU.
        status_file: status.json exists (a daemon runs). Today's daemon signals every rank of a job
            when one GPU is quarantined; the in-place rule signals only that GPU's ranks. Either
            way status.json says whose GPU it is; without a daemon a stop signal is for this rank.
    """
    if quarantined:
        return True
    if stop_reason is None:
        return False
    if stop_reason.startswith("gpuwatch quarantined") or stop_reason == "signal SIGTERM":
        return True
    return not status_file


def _connect(host: str, port: int, secret: bytes, timeout_s: float) -> JobStore:
    return JobStore(host, port, secret, datetime.timedelta(seconds=timeout_s))


def _visible_uuid() -> str | None:
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    return entries[0] if len(entries) == 1 and entries[0].startswith("GPU-") else None


def _is_cuda_fault(exc: BaseException) -> bool:
    """This rank's own CUDA error (an XID, an illegal address, ECC): its state may be bad, so it must not go on."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if isinstance(accelerator_error, type) and isinstance(exc, accelerator_error):
        return True
    return any(word in str(exc).lower() for word in _CUDA_FAULT_WORDS)


def _is_collective_failure(exc: BaseException) -> bool:
    """A peer's failure seen in a collective (gloo's or NCCL's errors), not this rank's own CUDA fault."""
    if _is_cuda_fault(exc):
        return False
    return isinstance(exc, dist.DistError) or any(word in str(exc).lower() for word in _COLLECTIVE_WORDS)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
