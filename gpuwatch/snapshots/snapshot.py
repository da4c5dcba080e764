"""HostSnapshot: a copy of the training state in shared memory that outlives the rank.

    snap = HostSnapshot(lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
                        every="auto", optimizer=optim, replicated=True)   # DDP: every rank holds it all
    with snap:
        restored = snap.resume(ckpt_dir)          # the host snapshot when it is there, else the disk
        if restored is not None:
            model.load_state_dict(restored.state["model"]); optim.load_state_dict(restored.state["optim"])
        step = restored.step if restored else 0
        while step < steps:
            ...forward, backward...
            optim.step()                          # waits (on the GPU) for a snapshot copy in flight
            step += 1
            snap.step(step)                       # every K steps: start the next snapshot
            if step % 500 == 0:
                snap.checkpoint(ckpt_dir, step)   # rank 0 writes it from the snapshot, in the background

The first `step()` sets both slots (and, on a GPU, a staging buffer) up on a thread (prepare.py).
Then every K steps `step()` starts copying the state into the older of the rank's two slots
(staged.py, copier.py) and returns: on a GPU the optimizer's update waits only for a device-to-device copy into
the staging buffer, which drains to the host over the next steps; the next snapshot starts once the
previous one committed (a staged one due before that starts at the commit, the loop never waits for a
drain), so a death with no survivor loses at most K steps (or a drain's, if more) plus a drain's.
`every="auto"` judges a snapshot by the loop's own step intervals with and without one in flight
and picks (and keeps re-checking) the K that keeps that under 1 % (cadence.py). A relaunch on the
same node restores the newest step every rank holds (agree.py), verified chunk by chunk, before it
reads the disk.

The slots are removed when the job finishes (the context exits without an error); a rank that
stops for resume or dies leaves them for the relaunch, and the daemon prunes a dead job's slots
after a grace period (prune.py). A reboot clears /dev/shm. What lives where: layout.py.

HostSnapshot ties its parts together, each with what it owns: pacing.py (when a snapshot is due,
"auto"'s K), rankslots.py (the rank's two slot files), slotsetup.py (where their set-up stands),
recall.py (which snapshot a relaunch restores), diskwrite.py (disk checkpoints from a snapshot, on
their own thread), updates.py (the optimizers' hook); it keeps the snapshot in flight itself.
Locking: HostSnapshot takes none; it is called on the training thread only (the optimizers' hook
runs there too), and the other threads (the set-up, a copy's drain, the disk write) reach it only
through the objects they were handed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuwatch.errors import CheckpointError
from gpuwatch.snapshots.agree import rank_and_world
from gpuwatch.snapshots.cadence import MAX_EVERY, TARGET_SHARE
from gpuwatch.snapshots.copier import CopyJob
from gpuwatch.snapshots.diskwrite import DiskWriter
from gpuwatch.snapshots.layout import (
    SnapshotDirError,
    job_dir_name,
    open_job_dir,
    remove_job_dir,
    snapshot_root,
    user_dir_name,
)
from gpuwatch.snapshots.pacing import Pacing, size_text
from gpuwatch.snapshots.prefetch import Prefetch
from gpuwatch.snapshots.prepare import Prepared
from gpuwatch.snapshots.rankslots import RankSlots
from gpuwatch.snapshots.recall import recall
from gpuwatch.snapshots.restore import like, localize, on_cuda
from gpuwatch.snapshots.slot import Slot
from gpuwatch.snapshots.slotsetup import SlotSetup
from gpuwatch.snapshots.staged import Layout, LayoutChanged, StagedJob, Stager, layout_of, tensor_ptrs
from gpuwatch.snapshots.updates import Updates
from gpuwatch.trainer import tensorfile
from gpuwatch.trainer.checkpoint import latest_step, load_latest, save_checkpoint

log = logging.getLogger("gpuwatch.snapshots")


@dataclass(frozen=True)
class Restored:
    """What `restore` or `resume` loaded: the step, the state, and where it came from ("memory" or "disk")."""

    step: int
    state: Any
    source: str
    where: str
    seconds: float
    skipped: list[tuple[str, str]] = field(default_factory=list)


class HostSnapshot:
    """Snapshots of one rank's training state in /dev/shm, every K steps, off the step.

    Args:
        state: returns the state to snapshot (a dict of state dicts, numbers, strings); called at the
            boundary of each snapshot. DTensors (FSDP2, DCP) are kept as this rank's local shards.
        every: steps between snapshots, or "auto" (measured: see the module doc).
        optimizer: the optimizer(s) that update the state in place; their update waits for a copy in
            flight. None: there is none to wait for, so each copy completes at the boundary (the commit
            still happens in the background).
        replicated: True when every rank holds the whole state (DDP): a relaunch with another world size
            may restore any rank's slot, and rank 0 writes disk checkpoints. False (sharded: FSDP, DCP):
            each rank restores only its own shards, and only into the same world size.
        job_id: the job's id; default $TORCHELASTIC_RUN_ID, else $GPUWATCH_JOB_ID (what `gpuwatch launch`
            keeps across relaunches; torchrun --standalone makes a new one per run).
        rank, world_size: default the process group's, else $RANK / $WORLD_SIZE, else 0 and 1.
        root: where the per-user directory goes; default $GPUWATCH_SNAPSHOT_ROOT, else /dev/shm.
        share: with every="auto", the share of the step a snapshot may cost (0.01: 1 %).
        max_every: with every="auto", the largest K it picks.
        staging: on a GPU, stage the copy in GPU memory (as much of the state as fits) so the optimizer
            waits only for a device-to-device copy (prepare.py); False: copy device-to-host directly.
        gpu_budget: the most GPU memory (bytes) staging may take; None: what is free after the first
            step, less a headroom; 0: none (as staging=False). stats()["gpu_bytes"] says what it took.

    Raises:
        ValueError: every is neither a positive integer nor "auto", there is no job id, or gpu_budget is
            not a number of bytes.
    """

    def __init__(
        self,
        state: Callable[[], Any],
        *,
        every: int | str = "auto",
        optimizer: Any = None,
        replicated: bool = False,
        job_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        root: str | None = None,
        share: float = TARGET_SHARE,
        max_every: int = MAX_EVERY,
        staging: bool = True,
        gpu_budget: int | None = None,
    ) -> None:
        if gpu_budget is not None and (
            isinstance(gpu_budget, bool) or not isinstance(gpu_budget, int) or gpu_budget < 0
        ):
            raise ValueError(f"gpu_budget must be a number of bytes (0 or more) or None, not {gpu_budget!r}")
        self._state_fn = state
        self._staging_wanted = staging
        self.gpu_budget = gpu_budget
        self._pacing = Pacing(every, share=share, max_every=max_every)
        self.replicated = replicated
        group = rank_and_world()
        self.rank = rank if rank is not None else group[0] if group else _env_int("RANK", 0)
        self.world_size = world_size if world_size is not None else group[1] if group else _env_int("WORLD_SIZE", 1)
        self.job_id = job_id or os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("GPUWATCH_JOB_ID") or ""
        if not self.job_id:
            raise ValueError("HostSnapshot needs a job id: pass job_id=, or set GPUWATCH_JOB_ID (gpuwatch launch does)")
        self.root = root or snapshot_root()
        self.directory = Path(self.root) / user_dir_name(os.getuid()) / job_dir_name(self.job_id)
        self.enabled = True
        self.disabled_reason: str | None = None
        self._updates = Updates(optimizer, self._before_update)
        self._files = RankSlots(None, self.rank)
        self._prefetch: Prefetch | None = None  # a read under way for a restore to come (prefetch)
        try:
            self._files.dir_fd = open_job_dir(self.root, self.job_id)
        except SnapshotDirError as exc:
            self._disable(str(exc))
        self._job: CopyJob | StagedJob | None = None
        self._stager: Stager | None = None  # the staged mode's buffer, stream and drain thread
        self._layout: Layout | None = None  # the state's layout, reused while its tensors are the same ones
        self._setup = SlotSetup()
        self._seq = (self._files.newest_seq() if self.enabled else 0) + 1
        self._base: int | None = None  # the step this process resumed from (None: not told yet)
        self._cuda: int | None = None
        self._disk = DiskWriter()
        self.snapshots = 0
        self.window_snapshots = 0  # of which taken in the set-up window
        self.committed_step: int | None = None
        self.state_bytes = 0
        self.setup_s = 0.0
        self.ready_step: int | None = None  # the step at which the slots were ready (snapshots start from there)
        self.ready_s: float | None = None  # seconds from the first step() to then, all off the training thread
        self._first_t: float | None = None
        self._step_now: int | None = None
        self.last_copy_s: float | None = None
        self.mode: str | None = None  # how a snapshot leaves the GPU (prepare.py); None until prepared

    # -- what the pacing keeps (pacing.py) ----------------------------------------------------------

    @property
    def every(self) -> int | None:
        """Steps between snapshots: as given, or as chosen by "auto" (None until its first snapshot is measured)."""
        return self._pacing.every

    @property
    def share(self) -> float:
        """With every="auto": the share of the step a snapshot may cost."""
        return self._pacing.share

    @property
    def max_every(self) -> int:
        """With every="auto": the largest K it picks."""
        return self._pacing.max_every

    @property
    def auto_basis(self) -> tuple[float, float] | None:
        """With "auto": (cost_s, step_s) it chose K from."""
        return self._pacing.auto_basis

    @property
    def last_cost_s(self) -> float | None:
        """What the last measured snapshot added to the loop (stats()["cost_s"])."""
        return self._pacing.last_cost_s

    @property
    def last_host_s(self) -> float | None:
        """Of that, the training thread's time inside `step` (stats()["host_s"])."""
        return self._pacing.last_host_s

    # -- resuming -----------------------------------------------------------------------------------

    def resume(
        self, checkpoint_dir: str | os.PathLike[str], *, like_state: Any = None, device: Any = None
    ) -> Restored | None:
        """The host snapshot when every rank has one at least as new as the disk's newest, else `load_latest`.

        All ranks call it (it agrees with the others). None when neither has anything.

        Args:
            checkpoint_dir: the checkpoint directory to fall back to.
            like_state: for sharded state, a state of the same structure (get_state_dict's): its DTensors'
                meshes and placements turn the restored local shards back into DTensors.
            device: a CUDA device: a host snapshot is restored onto it (see `restore`); None: CPU tensors.

        Raises:
            CheckpointError: the disk has checkpoints and none verifies (as load_latest).
        """
        started = time.perf_counter()
        restored = self.restore(like_state=like_state, at_least=latest_step(checkpoint_dir), device=device)
        if restored is not None:
            return restored
        loaded = load_latest(checkpoint_dir)
        self._resumed(loaded.step if loaded is not None else None)
        if loaded is None:
            return None
        seconds = time.perf_counter() - started
        return Restored(loaded.step, loaded.state, "disk", str(loaded.path), seconds, loaded.skipped)

    def restore(self, *, like_state: Any = None, at_least: int | None = None, device: Any = None) -> Restored | None:
        """The newest host snapshot every rank holds (at least step `at_least`), verified; None if there is none.

        All ranks call it: it is collective when there are several, also on a rank whose snapshots are off.
        device: None: CPU tensors (the rank's own slot mapped copy-on-write, no copy); a CUDA device:
        the tensors are copied onto it through pinned buffers, each chunk verified as it goes (memory
        speed; load_state_dict then copies on the GPU), and the slot is reused by the next snapshots.
        """
        started = time.perf_counter()
        prefetched, self._prefetch = self._prefetch, None
        try:
            found = recall(self._files.dir_fd if self.enabled else None, self.directory, rank=self.rank,
                           world_size=self.world_size, replicated=self.replicated, at_least=at_least,
                           device=device, prefetched=prefetched)  # fmt: skip
        finally:
            if prefetched is not None:
                prefetched.drop()
        if found is None:
            return None
        self._files.aliased = found.mapped_slot  # never to be written in place again
        self._resumed(found.step)
        state = found.state if like_state is None else like(found.state, like_state)
        seconds = time.perf_counter() - started
        log.info("restored step %d from host memory (%s) in %.2f s", found.step, found.where, seconds)
        return Restored(found.step, state, "memory", found.where, seconds)

    def prefetch(self, device: Any) -> None:
        """Start reading this rank's newest snapshot onto `device` (a CUDA one) now: `restore` takes it when it asks for
        that commit. For a process that joins holding no state, while its group forms (prefetch.py)."""
        dir_fd = self._files.dir_fd
        if self.enabled and dir_fd is not None and on_cuda(device) and self._prefetch is None:
            self._prefetch = Prefetch(dir_fd, rank=self.rank, world_size=self.world_size,
                                      replicated=self.replicated, device=device)  # fmt: skip

    def resumed_from(self, step: int | None) -> None:
        """Say which step the job resumed from when it loaded the state itself (resume() does this)."""
        self._resumed(step)

    def _resumed(self, step: int | None) -> None:
        """Snapshots of steps after `step` belong to a run that was abandoned: never load them."""
        self._base = step or 0
        self._pacing.started(self._base)
        if self.enabled:
            self._files.invalidate_after(self._base)

    # -- the training loop's side ---------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Call after each step's update with the step just finished; every K steps it starts a snapshot.

        The first call sets the slots up on a thread (prepare.py); snapshots start once they are ready.
        A snapshot in flight drains to the host over the next steps; the next one due starts after its
        commit (staged: at the step the commit is seen; otherwise the call waits for it), so the newest
        committed snapshot is never more than K steps (or a drain's, if more) behind the one in flight.
        The step intervals seen here, with and without a snapshot in flight, are what a snapshot costs
        the loop (stats(), and "auto"'s choice of K).
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        self._on_step(step, now)
        if self._job is not None:  # this call's time lands in the next interval, the job's: host_s says how much
            self._job.host_s += time.perf_counter() - now

    def _on_step(self, step: int, now: float) -> None:
        interval = self._pacing.time.tick(now)
        self._step_now = step
        if self._first_t is None:
            self._first_t = now
        if self._base is None:
            self._resumed(step - 1)
        ready = self.ready()
        if not ready and not self._usable():
            return
        job = self._job
        timed = ready and self.ready_step != step and not (job is not None and job.window)
        if interval is not None and timed:  # the set-up window's steps are neither plain nor a snapshot's
            self._pacing.time.record(interval, in_flight=job is not None)
            if job is not None:
                job.intervals.append(interval)
        if job is not None and job.committed.is_set():
            self._finish(job)
        elif isinstance(job, StagedJob):
            job.advance(self._drain_budget())
        if self._pacing.due(step, window=self._setup.window, idle=self._job is None):
            if self._job is not None and self._job.window:
                return  # a set-up window's copy is not waited for: the next starts once it commits
            if isinstance(self._job, StagedJob):  # K below the drain's floor: the next starts at its commit
                self._pacing.deferred(step)
                return
            if self._job is not None:  # K below the drain's floor: wait for the previous commit
                waiting = time.perf_counter()
                self._finish(self._job)
                self._pacing.waited(step, time.perf_counter() - waiting)
            if self.enabled:
                self._start(step)  # a staged drain starts at the next step (staged.py: not behind this copy)

    def _drain_budget(self) -> int:
        """Bytes the staged drain may queue this step (Stager.budget): a share of the plain step's time.

        Before any plain step was seen, the share is of the latest step's time: a snapshot that starts with
        the slots' first step leaves no plain step, and with a chunk a step the drain's rest fell to the next
        snapshot's start, on the loop."""
        assert self._stager is not None
        loop = self._pacing.time
        return self._stager.budget(loop.median_plain_step(recent=64) or loop.last_interval)

    def wait(self) -> None:
        """Wait until the snapshot in flight (if any) is committed."""
        if self._job is not None:
            self._finish(self._job)

    def snapshot_now(self, step: int) -> bool:
        """Take a snapshot of `step` and wait for its commit; False when snapshots are off or it failed."""
        if not self.enabled or not self._usable():
            return False
        self.wait()
        self._start(step)
        if self._job is None:
            return False
        self._finish(self._job)
        return self.committed_step == step

    def _before_update(self, *_: Any) -> None:
        """The optimizer's step pre-hook: the update must not change what a copy in flight still reads."""
        job = self._job
        if job is not None and not job.released:
            job.release_for_update()

    # -- setting the slots up (prepare.py) ------------------------------------------------------------

    def ready(self, *, wait: bool = False) -> bool:
        """Whether the slots (and the GPU staging) are set up; the first call starts that, on a thread.

        `step` calls it; call it yourself (wait=True) to have them before the loop starts, once the
        state exists (after the optimizer's first step, or the restore). False: not yet, or snapshots are off.
        """
        if self._setup.prepared is not None:
            return self.enabled
        if not self.enabled:
            return False
        if self._setup.preparation is None:
            self._prepare()
        preparation = self._setup.preparation
        if preparation is None or not (wait or preparation.done):
            return False
        self._adopt(preparation.join())
        return self.enabled

    def _usable(self) -> bool:
        """Whether a snapshot can be taken now: the slots are set up, or (the set-up window, a CPU state) mapped.

        A CPU state's snapshot in the window is copied on a thread into the slots as mapped, so the K
        bound holds from the first step. A CUDA state's waits for the set-up: into pageable memory, the
        window's drains held the loop's steps (12.9x a plain step at 16 GiB on an H100) and the slots'
        registration (that set-up took 45 s in one run, 100 s in another).
        """
        if self.ready():
            return True
        preparation = self._setup.preparation
        if not self.enabled or preparation is None or self._cuda is not None:
            return False
        if not self._setup.window:
            self._files.take(preparation.result)
            self._setup.window = True
            self.mode = preparation.result.mode
        return self.enabled

    def _prepare(self) -> None:
        """Lay the state out (references only) and start preparing slots and staging for its size."""
        assert self._files.dir_fd is not None
        try:
            flat = tensorfile.plan(localize(self._state_fn()))
            if flat is None:
                self._disable("the state holds values a flat tensor file cannot (custom objects, sparse tensors)")
                return
            cuda = _cuda_device(flat)
        except (OSError, ValueError) as exc:
            self._disable(f"cannot keep the state in {self.directory}: {exc}")
            return
        self._cuda, self.state_bytes = cuda, flat.size
        self._setup.start(self._files.dir_fd, self.rank, flat.size, cuda, staging=self._staging_wanted,
                          aliased=self._files.aliased, budget=self.gpu_budget)  # fmt: skip

    def _adopt(self, prepared: Prepared) -> None:
        """Take the prepared slots over, or turn snapshots off (one line) when they could not be made."""
        self._setup.prepared = prepared
        if prepared.error is not None:
            for slot in prepared.slots.values():
                slot.close()
            error = prepared.error
            self._disable(f"cannot keep the state in {self.directory}: {type(error).__name__}: {error}")
            return
        if not self._setup.window:
            self._files.take(prepared)
        self._setup.window = False
        self.setup_s += prepared.seconds
        self.ready_step = self._step_now
        self.ready_s = time.perf_counter() - self._first_t if self._first_t is not None else prepared.seconds
        self.mode = prepared.mode
        if prepared.mode == "staged" and prepared.pinned and self._cuda is not None:
            self._stager = Stager(prepared.staging, self._cuda)
        staged = 0 if prepared.staging is None else int(prepared.staging.numel())
        host = "pinned" if prepared.pinned else "pageable" if self._cuda is not None else "host"
        gpu = f", {size_text(staged)} of GPU memory for staging" if staged else ""
        mapped = max((slot.map_s for slot in self._files.slots.values()), default=0.0)
        log.info("host snapshots of %s: mode %s%s, %s slots in %s, ready in %.2f s (filled in %.2f s; set up off "
                 "the training thread)", size_text(self.state_bytes), prepared.mode, gpu, host, self.directory,
                 prepared.seconds, mapped)  # fmt: skip

    def _set_up_again(self, nbytes: int) -> None:
        """The state outgrew the slots (or moved): new ones are set up off the training thread, under temp names
        so that the committed snapshots stay loadable meanwhile; snapshots resume once they are ready."""
        log.info("host snapshot state is now %s: setting its slots up again, off the training thread",
                 size_text(nbytes))  # fmt: skip
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._setup.again()  # the GPU memory goes back before the new buffer is taken
        self._layout = None
        self.ready()

    # -- one snapshot: its start and its commit (copier.py, staged.py) -----------------------------------

    def _start(self, step: int) -> None:
        try:
            state = self._state_fn()
            staged = self._staged_layout(state)
            if staged is not None:
                layout, replan = staged
                flat, cuda = layout.flat, self._cuda
            else:
                planned = tensorfile.plan(localize(state))
                if planned is None:
                    self._disable("the state holds values a flat tensor file cannot (custom objects, sparse tensors)")
                    return
                flat, cuda = planned, _cuda_device(planned)
            if cuda != self._cuda or any(slot.payload_capacity < flat.size for slot in self._files.slots.values()):
                self._set_up_again(flat.size)  # a CPU state's new slots are usable at once (the set-up window)
                if not self._usable() or any(s.payload_capacity < flat.size for s in self._files.slots.values()):
                    return
            slot = self._target(flat.size, cuda)
            job: CopyJob | StagedJob
            if staged is not None and self._stager is not None and slot.pinned:
                job = StagedJob(step, self._seq, slot, layout, self._stager, self.world_size, self.rank, replan)
            else:
                if self._stager is not None:  # the copy below writes the staging buffer in its own layout
                    self._stager.layout = None
                job = self._copy_job(step, slot, flat, cuda)
        except (OSError, ValueError) as exc:
            self._disable(f"cannot keep the state in {self.directory}: {exc}")
            return
        self._seq += 1
        self._cuda, self.state_bytes = cuda, flat.size
        self._pacing.started(step)
        self._job = job
        if not self._updates.optimizers:
            job.release_for_update()  # nothing tells us before the state changes: the copy completes now

    def _copy_job(self, step: int, slot: Slot, flat: tensorfile.FlatState, cuda: int | None) -> CopyJob:
        return CopyJob(step, self._seq, slot, flat, self._updates.owned(flat), cuda, self.world_size, self.rank,
                       self._setup.staging(), window=self._setup.window)  # fmt: skip

    def _staged_layout(self, state: Any) -> tuple[Layout, Any] | None:
        """In the staged mode: the state's layout (reused while its tensors are the same ones) and, when reused,
        what plans the boundary's state again off the step (StagedJob checks it there); else None."""
        if self._stager is None:
            return None
        ptrs = tensor_ptrs(state)
        layout = self._layout
        if layout is not None and layout.ptrs == ptrs:
            return layout, lambda: tensorfile.plan(localize(state))
        flat = tensorfile.plan(localize(state))
        if flat is None or _cuda_device(flat) != self._cuda or flat.size > self._stager.staging.numel():
            self._layout = None
            return None
        planned = {s.data_ptr() for s in flat.sources}
        layout = layout_of(flat, self._updates.owned(flat), ptrs)
        self._layout = layout if planned <= set(ptrs) else None  # a copied (non-contiguous) tensor: plan each time
        return layout, None

    def _target(self, nbytes: int, cuda: int | None) -> Slot:
        """The slot the next snapshot goes into, sized for `nbytes`: the one not holding the newest commit
        (nor being written to disk: then wait for that write)."""
        k = self._files.oldest()
        if self._disk.slot == k:
            self._disk.join()
        slot = self._files.claim(k)
        setup_s = 0.0 if self._setup.window else slot.ensure(nbytes, pin=cuda is not None)  # the window: as mapped
        if setup_s:
            log.info("host snapshot slot %s: %s in %s, set up in %.2f s", slot.name, size_text(nbytes),
                     self.directory, setup_s)  # fmt: skip
        self.setup_s += setup_s
        return slot

    def _finish(self, job: CopyJob | StagedJob) -> None:
        job.release_for_update()
        job.wait_committed()
        self._job = None
        if isinstance(job.error, LayoutChanged):  # dropped; the next snapshot plans the state afresh
            log.info("host snapshot of step %d dropped: %s", job.step, job.error)
            self._layout = None
            return
        if job.error is not None:
            self._disable(f"the snapshot of step {job.step} failed: {type(job.error).__name__}: {job.error}")
            return
        self.snapshots += 1
        self.committed_step = job.step
        self.last_copy_s = job.copy_s
        if job.window:  # taken while the slots were set up: its steps say nothing of a snapshot's cost
            self.window_snapshots += 1
            return
        every = self._pacing.every
        self._pacing.committed(job, self.state_bytes)
        if self.snapshots == 1 or every != self._pacing.every:
            log.info("%s", self.describe())

    def describe(self) -> str:
        """One line: the mode, the GPU memory it takes, the cadence and the steps a death may lose."""
        bound, every_k = self.loss_bound(), self._pacing.every
        every = f"every {every_k} step(s)" if every_k else "K not chosen yet"
        drain_steps = self._pacing.drain_steps()
        lose = (
            "?" if bound is None or drain_steps is None else f"{bound} ({bound - drain_steps} + {drain_steps} of drain)"
        )
        return (f"host snapshots of {size_text(self.state_bytes)}: mode {self.mode}, {size_text(self.gpu_bytes())} "
                f"of GPU memory, {every}; a death with no survivor loses at most {lose} steps")  # fmt: skip

    def loss_bound(self) -> int | None:
        """Steps a death with no survivor loses at most: K (or a drain's steps, where K is under them), plus the
        steps a snapshot's drain spans (the one in flight is not committed yet). None until one was measured."""
        return self._pacing.loss_bound()

    def gpu_bytes(self) -> int:
        """The GPU memory the snapshots hold between snapshots (the staging buffer)."""
        staging = self._setup.staging()
        return 0 if staging is None else int(staging.numel())

    # -- disk checkpoints from the snapshot (diskwrite.py) ----------------------------------------------

    def checkpoint(self, directory: str | os.PathLike[str], step: int, *, keep: int = 3, wait: bool = False) -> None:
        """Write the checkpoint of `step` from the host snapshot, in the background (`wait`: before returning).

        Replicated state only: rank 0 writes, the others return at once; no collective call. The
        snapshot of `step` is the one in flight or committed, else one is taken now (a synchronous copy:
        make the checkpoint cadence a multiple of K). With snapshots off, rank 0 saves with
        save_checkpoint (single writer) instead. A later snapshot that needs the slot being written
        waits for the write, so keep the checkpoint cadence longer than one disk write.

        Raises:
            ValueError: the state is sharded (write its checkpoint with DCP), or keep is below 1.
            CheckpointError: the previous background checkpoint failed, or (wait) this one did.
        """
        if not self.replicated:
            raise ValueError("HostSnapshot.checkpoint is for replicated state; save sharded state with DCP")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        if self.rank != 0:
            return
        self._disk.join()
        job = self._job if self._job is not None and self._job.step == step else None
        k = None if job is not None else self._committed_slot(step)
        if job is None and k is None and self._usable():  # K does not divide the checkpoint cadence
            if self._job is not None:
                self._finish(self._job)
            if self.enabled:
                self._start(step)  # a snapshot of this step now; the disk write waits for its commit
                job = self._job
        if job is not None:
            k = next(key for key, slot in self._files.slots.items() if slot is job.slot)
        if k is None:
            save_checkpoint(directory, step, self._state_fn(), keep=keep, single_writer=True)
            return
        slot_k, draining = k, job
        self._disk.start(k, lambda: self._write_when_committed(Path(directory), step, slot_k, keep, draining))
        if wait:
            self._disk.join()

    def rescue(self, directory: str | os.PathLike[str], last: int) -> Path:
        """A survivor's rescue (TrainerLink.rescue's save): commit `last` in host memory, then write it to disk.

        The host commit takes a device-to-host copy (seconds at most); a relaunch on this node resumes
        from it even if torchrun kills the rank before the disk write ends. The disk write goes from the
        host snapshot at the disk's speed, as a single writer (any survivor may write the same step).

        Raises:
            CheckpointError: the checkpoint could not be written.
        """
        try:
            self._disk.join()
        except CheckpointError as exc:  # an earlier background write's failure must not stop the rescue
            log.error("%s", exc)
        if self._slot_of(last) is None:
            self.snapshot_now(last)
        k = self._slot_of(last)
        if k is None:  # snapshots off or failed: serialise from the state as before
            return save_checkpoint(directory, last, self._state_fn(), single_writer=True)
        return self._disk.write(self._files.slot(k), Path(directory), last, keep=3, single_writer=True)

    def _slot_of(self, step: int) -> int | None:
        """The slot holding the committed snapshot of `step` (waiting for it when it is in flight), else None."""
        if not self.enabled:
            return None
        if self._job is not None and self._job.step == step:
            self._finish(self._job)
        return self._committed_slot(step)

    def _committed_slot(self, step: int) -> int | None:
        """The slot holding the committed snapshot of `step`, else None (no waiting)."""
        return self._files.holding(step) if self.enabled else None

    def _write_when_committed(
        self, directory: Path, step: int, k: int, keep: int, job: CopyJob | StagedJob | None
    ) -> None:
        """The background write: once the snapshot of `step` (perhaps still draining) is committed."""
        if job is not None:
            job.committed.wait()
            if job.error is not None:
                raise CheckpointError(f"the host snapshot of step {step} failed: {job.error}")
        self._disk.write(self._files.slot(k), directory, step, keep=keep, single_writer=False)

    # -- lifecycle ------------------------------------------------------------------------------------

    def close(self, *, remove: bool) -> None:
        """Wait for what is in flight, then release the slots; `remove` deletes them (the job is finished).

        Idempotent. A rank that stops for resume or fails keeps them (remove=False) for the relaunch.
        """
        try:
            if self._job is not None and self.enabled:
                self._finish(self._job)
            self._disk.join()
            if self._setup.preparation is not None and self._setup.prepared is None:
                self._adopt(self._setup.preparation.join())  # its slots are closed below
        except Exception as exc:  # at exit, perhaps after another error (a lost GPU): say it, do not mask that one
            log.error("host snapshot of rank %s at close: %s: %s", self.rank, type(exc).__name__, exc)
        finally:
            self._updates.remove_hooks()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._layout = None
            if self._prefetch is not None:  # its thread reads from the job directory closed below
                self._prefetch.drop()
                self._prefetch = None
            self._setup.release_staging()  # the GPU memory goes back to the caching allocator
            self._files.close(drop_renames=self._setup.prepared is not None)
            if remove and self._files.dir_fd is not None:
                self._files.remove_files(self.world_size)
            if self._files.dir_fd is not None:
                self._files.close_dir()
                if remove:
                    remove_job_dir(self.root, self.job_id)

    def __enter__(self) -> HostSnapshot:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        finished = exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None))
        self.close(remove=finished)

    def stats(self) -> dict[str, Any]:
        """What the snapshots cost and hold, for logs and the bench (looptime.py says how the costs are measured).

        cost_share is what snapshots cost the loop's wall time: the mean step interval over the recent
        steps since snapshots run (at the current K) against the mean plain step (step_s), less one.
        cost_s is what the last snapshot added to the loop: the step intervals it was in flight for,
        less as many typical (median) plain steps; mean_cost_s the same over the last snapshots
        ("auto" chooses K from it, then raises K while cost_share is over its share). drain_s: from a
        snapshot's boundary to its commit. host_s is the part of cost_s the training thread spent
        inside `step` for that snapshot (the boundary and the drain's portions); the rest is the
        GPU's (the copies' competition with the steps). ready_step and ready_s: when the slots were set up (off the
        training thread); snapshots start there.
        """
        staged = self.gpu_bytes()
        loop = self._pacing.time
        prepared = self._setup.prepared
        budget = prepared.budget if prepared else None  # what the default left for a standby, and why
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "directory": str(self.directory),
            "every": self._pacing.every,
            "snapshots": self.snapshots,
            "window_snapshots": self.window_snapshots,
            "committed_step": self.committed_step,
            "state_bytes": self.state_bytes,
            "host_bytes": 2 * self.state_bytes,
            "setup_s": self.setup_s,
            "ready_step": self.ready_step,
            "ready_s": self.ready_s,
            "mode": self.mode,
            "pinned": self._setup.pinned,
            "staging_bytes": staged,
            "gpu_bytes": self.gpu_bytes(),
            "gpu_budget": budget.limit if budget else self.gpu_budget,
            "gpu_budget_why": budget.why if budget else None,
            "loss_bound_steps": self.loss_bound(),
            "copy_s": self.last_copy_s,
            "drain_s": loop.median_drain(),
            "cost_s": self.last_cost_s,
            "host_s": self.last_host_s,
            "mean_host_s": loop.mean_host(),
            "mean_cost_s": loop.mean_cost(),
            "step_s": loop.plain_step(),
            "cost_share": loop.wall_share(),
            "waited_snapshots": self._pacing.waits,
            "waited_s": self._pacing.wait_s,
            "deferred_snapshots": self._pacing.defers,
            "device": "cpu" if self._cuda is None else f"cuda:{self._cuda}",
            "auto_basis": self.auto_basis,
        }

    def _disable(self, reason: str) -> None:
        if self.enabled:
            log.warning("host snapshots off for rank %s of job %s: %s; resuming from the disk", self.rank,
                        self.job_id, reason)  # fmt: skip
        self.enabled = False
        self.disabled_reason = reason
        self._job = None


def _cuda_device(flat: tensorfile.FlatState) -> int | None:
    """The CUDA device of the state's tensors (None: all on the CPU); one device per rank."""
    devices = {s.device.index for s in flat.sources if s.device.type == "cuda"}
    if len(devices) > 1:
        raise ValueError(f"the state is on several CUDA devices {sorted(devices)}: one rank, one device")
    return int(devices.pop() or 0) if devices else None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
