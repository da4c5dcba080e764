"""The step engine: one loop, in one process, for every job shape that recovers in place.

Under `gpuwatch launch --in-place` every worker is one member of the job; the membership comes in
generations that the launcher hosting the job's store publishes (gpuwatch.inplace.coordinator).
Each generation has its own process group (the default group, created anew under the store prefix
`pg/<g>/`). A step, `StepEngine.train_step(fn)`, is:

1. the boundary: one MAX all-reduce of the newest generation each rank has seen (the store pushes
   each new one: gpuwatch.inplace.membership), so all ranks switch at the same step; a rank whose GPU is quarantined
   asks to leave here and goes on stepping until the others have switched;
2. `fn(source.module)`: the forward and backward passes; it must not change the state;
3. `source.before_update()`, the update (`source.update()`, the optimizer's step), `source.after_step()`.

When any of it fails because a peer is gone (gpuwatch.trainer.faults says which errors are a peer's),
the rank reports the failure, waits for the next generation, forms it and runs the step again.
What differs between job shapes is only where the state comes from, and that is the `StateSource`
the engine is given (the contract below): DDP's peer broadcast (gpuwatch.inplace.job), the rollback
to the host snapshots of sharded jobs (gpuwatch.inplace.sharded) and FSDP2 / DTensor meshes rebuilt
per generation (gpuwatch.inplace.fsdp).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpuwatch.errors import InPlaceError
from gpuwatch.inplace import subgroups
from gpuwatch.inplace.groupproof import form_group
from gpuwatch.inplace.jobstore import JobStore
from gpuwatch.inplace.membership import Membership
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
)
from gpuwatch.inplace.relay import RELAY_ENV
from gpuwatch.inplace.secret import SECRET_FILE_ENV, read_secret
from gpuwatch.inplace.sockets import shut_down, socket_inodes
from gpuwatch.inplace.watcher import Ticker
from gpuwatch.trainer.contract import (
    DEFAULT_RUNTIME_DIR,
    RECOVERY_IN_PLACE,
    RUNTIME_DIR_ENV,
    STATUS_FILE,
    quarantined_in,
)
from gpuwatch.trainer.faults import Fault, classify, first_line
from gpuwatch.trainer.link import TrainerLink
from gpuwatch.trainer.standby import first_step_done, wait_for_rank

log = logging.getLogger("gpuwatch.inplace")
T = TypeVar("T")

_PARTS = ("before", "rendezvous", "group", "state")  # a membership change's parts (Change.parts)
_PLACES_KEY = "places"  # the job's places once it shrank or grew (keeps_place sources)
_DONE_WAIT_S = 0.02  # how long a rank waits before it looks again when the job is done but no generation came


class NotInPlace(InPlaceError, RuntimeError):
    """The process was not started by `gpuwatch launch --in-place` (its store and member id are missing)."""


@dataclass(frozen=True)
class Change:
    """The last membership change this rank went through, for the job's own log."""

    generation: int
    reason: str
    source: str  # "held" (kept its state), "peer" (received it), "memory" (host snapshot), "checkpoint", "fresh"
    seconds: float  # from the failure, the boundary or the start to the new group's first step
    moved_bytes: int
    parts: dict[str, float] = field(default_factory=dict)  # where `seconds` went: before, rendezvous, group, state


@dataclass(frozen=True)
class Group:
    """What a state source is told of this rank's group of a generation (before_group: about to form; sync: formed)."""

    rank: int
    world_size: int
    places: int  # the job's places before this generation (its first one's size, until it shrank)
    held: int | None  # the step whose state this rank holds, None when it holds none (a new or broken rank)
    device: torch.device


@dataclass(frozen=True)
class Synced:
    """What a state source did in `sync`: the step every rank now holds, where this rank's state came from."""

    step: int
    origin: str  # held, peer, memory, checkpoint, fresh (Change.source)
    moved_bytes: int = 0


class StateSource:
    """How one job shape's state survives a membership change: the engine's only job-specific part.

    The contract (tests/inplace/test_state_sources.py runs it over every implementation): after `sync`
    in a new group, every rank holds the state of one step (the same on all ranks, returned), equal to
    what an uninterrupted run holds there, whatever ranks held before (all, some, or none of it).
    """

    keeps_place = False  # True: a rank keeps its shard's place (rank); only a generation with every place trains
    collective_update = False  # True: the update holds a collective (ZeRO's broadcast): it can fail for a peer

    @property
    def module(self) -> Any:
        """What the step's function is given (the DDP wrapper, the FSDP module)."""
        raise NotImplementedError

    def may_train(self, generation: Generation, places: int) -> bool:
        """Whether `generation` trains with the job's `places` (else its members wait for the next one)."""
        return not self.keeps_place or len(generation.members) >= places

    def sync(self, group: Group) -> Synced:
        """In the new group: make every rank hold the newest step's state all can have; bind the model to it."""
        raise NotImplementedError

    def before_group(self, group: Group) -> None:
        """This rank holds no state and takes it in `sync` (`group` as sync will get it, held None): start now
        what can run while the group forms."""

    def unbind(self) -> None:
        """The group is about to go: drop what refers to it (a DDP wrapper, a mesh)."""

    def before_update(self) -> None:
        """After the step's function, before the update: what the update must not overtake (a snapshot's copy)."""

    def update(self) -> None:
        """The update: the optimizer's step."""
        raise NotImplementedError

    def after_step(self, step: int) -> None:
        """After step `step` completed (e.g. start a host snapshot when due)."""

    def close(self, *, finished: bool) -> None:
        """The job ends for this rank (`finished`: its work is done, nothing needs to outlive it)."""


class StepEngine:
    """One rank of a job that recovers in place (see the module docstring).

    Args:
        source: the job shape's StateSource.
        link: the rank's TrainerLink: told `recovery = "in_place"`, its stop request (a quarantine of
            this rank's GPU) makes the rank leave, and it is closed with exit 75 when it has left.
        save: called with the step when this rank leaves and no member is left to hold the state.
        backend: "nccl" or "gloo"; default nccl when CUDA is there.
        collective_timeout_s: the process groups' timeout (gloo's only way out of a hung peer).
        membership_timeout_s: how long a rank waits for a new generation before it gives up.

    Raises:
        NotInPlace: GPUWATCH_INPLACE_STORE, GPUWATCH_INPLACE_MEMBER or GPUWATCH_INPLACE_SECRET_FILE is not set.
        SecretError: the secret file is not this user's own private file.
        TimeoutError: no generation with this rank formed within membership_timeout_s.
        SystemExit: 0 when the job's work was done before this rank was taken in (a late replacement).
    """

    def __init__(
        self,
        source: StateSource,
        link: TrainerLink | None = None,
        *,
        save: Callable[[int], object] | None = None,
        backend: str | None = None,
        collective_timeout_s: float = 30.0,
        membership_timeout_s: float = 600.0,
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
        secret = self._secret = read_secret(secret_file)
        # Kept here: a Python store that only torch holds loses its methods (torch calls a pure virtual).
        self._connections = [_connect(host, int(port), secret, membership_timeout_s) for _ in range(2)]
        self._store = dist.PrefixStore(prefix, self._connections[0])
        self.source, self._link, self._save = source, link, save
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self._timeout = datetime.timedelta(seconds=collective_timeout_s)
        self._membership_timeout_s = membership_timeout_s
        self._place_key = f"{os.environ.get(NODE_ENV, '0')}:{os.environ.get('RANK', '0')}"
        self._places: int | None = None
        self._step = 0
        self._has_state = False
        self._gen: Generation | None = None
        self._leave_sent = False
        self._quarantined = False
        self._in_collective = False
        self._aborted_for = 0
        self._group_sockets: dict[int, int] = {}  # fd -> inode: the generation's group's and source's
        self._pending: tuple[int, float] | None = None  # (generation, since): to form at the next step's start
        self._gpu_uuid = link.gpu_uuid if link is not None else _visible_uuid()
        runtime_dir = (
            link.runtime_dir if link is not None else Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
        )
        self._status_path = Path(runtime_dir) / STATUS_FILE
        self._status_key: tuple[int, int] | None = None
        self.last_change: Change | None = None
        if link is not None:
            link.recovery = RECOVERY_IN_PLACE
        watch, ask = self._connections[1], self._connections[0]
        relay = os.environ.get(RELAY_ENV)  # the node's launcher relays the generations
        self._membership = Membership(watch, ask, f"{prefix}/", on_new=self._abort_if_peer_gone, relay=relay)
        self._status_ticker = Ticker(self._check_status)
        self._join()

    def _join(self) -> None:
        """The join point: say this member is up, wait for the first generation that takes it in, form it."""
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

    def train_step(self, fn: Callable[[Any], T]) -> T:
        """Take one step: agree on the membership, run `fn(source.module)` (forward, backward), update.

        `fn` reads `rank` and `world_size` for its share of the global batch and must leave the state
        alone (gradients only): when a peer fails during the step, it runs again in the new generation
        from the state the source brings back (the same step, or an older one after a rollback).

        Raises:
            SystemExit: 75 when this rank's GPU is quarantined and the others have left it.
            Exception: fn's own error when it is no peer's failure.
        """
        while True:
            before = time.monotonic()
            failure = None
            updating = False
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
                result = fn(self.source.module)
                self._settle()
                self.source.before_update()
                updating = True
                self.source.update()
                if self.source.collective_update:
                    self._settle()
            except TimeoutError:
                raise  # no membership formed in membership_timeout_s: nothing left to wait for
            except Exception as exc:
                fault = classify(exc)
                if not (fault is Fault.COLLECTIVE or (self._aborted_for and fault is not Fault.CUDA)):
                    raise
                failure = f"{type(exc).__name__}: {first_line(exc)}"  # not exc: its frames hold the old group
            finally:
                self._in_collective = False
            if failure is None:
                break
            if updating:  # the update ran in part: this rank's state is no step's state any more
                self._has_state = False
            self._after_failure(failure, before)
        self._step += 1
        self.source.after_step(self._step)
        first_step_done()  # a spare that became this rank says so once: the next spare starts behind it now
        return result

    def _settle(self) -> None:
        """Make sure the step's collectives really ended before the state changes.

        An aborted NCCL collective may return instead of raising, leaving garbage in the gradients;
        and a collective may still be running on the GPU when fn returns. So on NCCL, wait for the
        stream, then treat an abort during the step as the failure it is.
        """
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()
        if self._aborted_for:
            raise RuntimeError(f"the process group was aborted during the step (generation {self._aborted_for})")

    def close(self, *, finished: bool = True) -> None:
        """Stop the watchers, destroy the process group, close the source (idempotent)."""
        self._status_ticker.close()
        self._membership.close()
        self._destroy_group()
        self.source.close(finished=finished)

    # -- generations ----------------------------------------------------------------------------

    def _boundary(self) -> int:
        """The newest generation any rank has seen (one MAX all-reduce); asks to leave first when due."""
        if not self._leave_sent and self._wants_leave():
            self._leave_sent = True
            reason = "status.json quarantines its GPU" if self._quarantined else (self._link and self._link.stop_reason)
            log.warning("member %s (rank %d) leaves the job: %s", self.member, self.rank, reason)
            append_event(self._store, LEAVE, member=self.member)
        seen = torch.tensor([max(self._membership.latest, self.generation)], dtype=torch.int64, device=self._device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        agreed = int(seen.item())
        if self._aborted_for:  # the aborted all-reduce returned: its value means nothing
            raise RuntimeError(f"the process group was aborted at the boundary (generation {self._aborted_for})")
        return agreed

    def _after_failure(self, failure: str, since: float) -> None:
        """A collective failed: close the group at once, say so, wait for the next generation (formed next).

        Closing first matters: a survivor may be blocked receiving from this rank (alive, so gloo
        sees no error) rather than from the dead one. gloo has no abort (torch 2.13), and its
        connections close only when the last reference to the group goes (a DDP's hooks on the
        module's parameters keep one), so this rank shuts down the group's own sockets: a peer
        waiting on it gets "connection closed" at once.
        """
        failed_in = self.generation
        log.warning("member %s: collective failed in generation %d: %s", self.member, failed_in, failure)
        shut_down(self._group_sockets)
        self._destroy_group()
        append_event(self._store, FAILED, member=self.member, gen=failed_in)
        deadline = time.monotonic() + self._membership_timeout_s
        while (latest := self._membership.wait_newer(failed_in, deadline - time.monotonic())) <= failed_in:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new generation after generation {failed_in} failed: {failure}")
            time.sleep(_DONE_WAIT_S)  # the job is done: no generation comes, wait out the deadline
        self._pending = (latest, since)

    def _first_generation_with_me(self) -> int:
        deadline = time.monotonic() + self._membership_timeout_s
        latest = self._membership.latest
        while True:
            if latest and self.member in self._membership.generation(latest).members:
                return latest
            self._end_if_done(f"before member {self.member} was taken in")
            if time.monotonic() > deadline:
                raise TimeoutError(f"member {self.member}: no generation took it in")
            latest = self._membership.wait_newer(latest, max(0.0, deadline - time.monotonic()))

    def _reform(self, target: int, since: float) -> None:
        """Leave the old group, meet the members of the newest generation, form its group, sync the state."""
        self._destroy_group()
        marks = [time.monotonic()]
        generation = self._rendezvous(target)
        if self.member not in generation.members:
            self._leave(generation)
        marks.append(time.monotonic())
        rank, world = self._position(generation), len(generation.members)
        if not self._has_state:
            self.source.before_group(Group(rank, world, self._place_count(), None, self._device))
        sockets_before = socket_inodes()
        self._form_group(generation, rank, world)
        marks.append(time.monotonic())
        held = self._step if self._has_state else None
        try:
            synced = self.source.sync(Group(rank, world, self._place_count(), held, self._device))
        finally:  # the source's own groups too (a device mesh's subgroups): a failure shuts them down with it
            self._group_sockets = {fd: ino for fd, ino in socket_inodes().items() if sockets_before.get(fd) != ino}
        self._step, self._has_state = synced.step, True
        if self.source.keeps_place and world != self._place_count():  # shrunk or grown: the job's places now
            self._places = world
            if rank == 0:  # for a rank that joins later
                self._store.set(_PLACES_KEY, str(world))
        if self._link is not None:
            self._link.rank, self._link.world_size = rank, world
        marks.append(time.monotonic())
        spans = [marks[0] - since, *(b - a for a, b in zip(marks, marks[1:], strict=False))]
        parts = {name: round(s, 4) for name, s in zip(_PARTS, spans, strict=True)}
        seconds = time.monotonic() - since
        self.last_change = Change(
            generation.number, generation.reason, synced.origin, seconds, synced.moved_bytes, parts
        )
        log.debug("member %s: generation %d: %s", self.member, generation.number, parts)
        log.info(
            "member %s: generation %d (%s): rank %d of %d, state %s, %.2f s",
            self.member, generation.number, generation.reason, rank, world, synced.origin, seconds,
        )  # fmt: skip

    def _form_group(self, generation: Generation, rank: int, world: int) -> None:
        """The one place a generation's process group is formed (the default group, under `pg/<generation>/`)."""
        form_group(  # the group proves itself (gpuwatch.inplace.groupproof) before it carries state
            self.backend, self._store, f"pg/{generation.number}", rank, world,
            self._timeout, self._secret, self._device, label=f"generation {generation.number}",
        )  # fmt: skip
        subgroups.install()  # the groups the script makes later prove themselves too
        self._gen = generation
        self._aborted_for = 0

    def _position(self, generation: Generation) -> int:
        """This rank in the generation's group: its place among the members, or its shard's place (keeps_place)."""
        if not self.source.keeps_place:
            return generation.members.index(self.member)
        keys = {m: _place(self._store.get(f"shard/{m}").decode()) for m in generation.members}
        return sorted(generation.members, key=lambda m: keys[m]).index(str(self.member))

    def _place_count(self) -> int:
        """The job's places: the size of its first generation, or what it shrank or grew to (read once)."""
        if self._places is None:
            changed = self._store.check([_PLACES_KEY])
            self._places = int(self._store.get(_PLACES_KEY)) if changed else len(self._membership.generation(1).members)
        return self._places

    def _rendezvous(self, target: int) -> Generation:
        """Wait until every member of the newest generation (from `target` on) is here, and it may train."""
        if self.source.keeps_place:
            self._store.set(f"shard/{self.member}", self._place_key)
        deadline = time.monotonic() + self._membership_timeout_s
        while True:
            generation = self._meet(target)
            if self.member not in generation.members or self.source.may_train(generation, self._place_count()):
                return generation
            while (target := self._membership.wait_newer(generation.number, 1.0)) <= generation.number:
                if time.monotonic() > deadline:  # a place is empty: wait for the generation that fills it
                    raise TimeoutError(f"generation {generation.number} lacks a shard and none came back")

    def _meet(self, target: int) -> Generation:
        """The store barrier of the newest generation from `target` on: one counter every member adds itself to."""
        deadline = time.monotonic() + self._membership_timeout_s
        number = max(target, self._membership.latest)
        while True:
            generation = self._membership.generation(number)
            if self.member not in generation.members:
                return generation
            left_s = max(0.001, deadline - time.monotonic())
            if self._membership.meet(number, len(generation.members), left_s, until_done=not self._has_state):
                return generation
            if self._membership.latest > number:
                number = self._membership.latest
                continue
            if not self._has_state:  # a joiner whose generation's members finished meanwhile
                self._end_if_done(f"while member {self.member} waited to join generation {number}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {number}: not every member arrived ({len(generation.members)})")

    def _end_if_done(self, when: str) -> None:
        """A member finished: no generation comes any more, so this rank, which holds nothing, ends with 0."""
        if self._store.check([DONE]):
            log.warning("member %s: the job's work was done %s: nothing left for it", self.member, when)
            self.close()
            raise SystemExit(0)

    def _leave(self, generation: Generation) -> None:
        """This rank is not in the new generation: it left (quarantine) or was taken for gone."""
        if not self._leave_sent:
            raise RuntimeError(f"member {self.member} was dropped from generation {generation.number}")
        self._status_ticker.close()
        self._membership.close()
        if not generation.members and self._save is not None and self._has_state:
            log.warning("member %s: no member is left to hold the state: saving step %d", self.member, self._step)
            self._save(self._step)
        why = f"left in place at step {self._step}; generation {generation.number} goes on without it"
        log.warning("member %s: %s", self.member, why)
        if self._link is not None:
            self._link.exit_for_resume(why)
        raise SystemExit(75)

    def _destroy_group(self) -> None:
        self.source.unbind()
        self._gen = None  # the watcher aborts only a group that exists
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a group whose peer is gone may fail to shut down cleanly
                dist.destroy_process_group()

    # -- the watcher's callbacks (its thread) -----------------------------------------------------

    def _wants_leave(self) -> bool:
        link = self._link
        reason = link.stop_reason if link is not None and link.stop_requested else None
        if reason is not None and not self._quarantined:
            self._check_status()  # the daemon writes status.json before it signals: read it now, not at the next poll
        return leaves(reason, quarantined=self._quarantined, status_file=self._status_path.exists())

    def _abort_if_peer_gone(self, newest: Generation) -> None:
        """NCCL waits for a dead peer: abort the group so the main thread's collective fails (gloo fails by itself)."""
        current, latest = self._gen, newest.number
        if current is None or self.backend != "nccl" or not self._in_collective or latest <= current.number:
            return
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


def _place(text: str) -> tuple[int, int]:
    node, _, rank = text.partition(":")
    return (int(node), int(rank)) if node.isdigit() and rank.isdigit() else (1 << 30, 0)
