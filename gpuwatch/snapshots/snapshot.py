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
the staging buffer, which drains to the host over the next steps; the next snapshot due waits for
the previous commit, so a death with no survivor loses at most K steps plus the steps a drain spans.
`every="auto"` judges a snapshot by the loop's own step intervals with and without one in flight
and picks (and keeps re-checking) the K that keeps that under 1 % (cadence.py). A relaunch on the
same node restores the newest step every rank holds (agree.py), verified chunk by chunk, before it
reads the disk.

The slots are removed when the job finishes (the context exits without an error); a rank that
stops for resume or dies leaves them for the relaunch, and the daemon prunes a dead job's slots
after a grace period (prune.py). A reboot clears /dev/shm. What lives where: layout.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from gpuwatch.errors import CheckpointError
from gpuwatch.snapshots.agree import common_steps, everyone, rank_and_world
from gpuwatch.snapshots.cadence import MAX_EVERY, TARGET_SHARE, choose_every, parse_every
from gpuwatch.snapshots.copier import CopyJob
from gpuwatch.snapshots.layout import (
    SLOTS,
    SnapshotDirError,
    job_dir_name,
    open_job_dir,
    parse_slot_name,
    remove_job_dir,
    slot_name,
    snapshot_root,
    user_dir_name,
)
from gpuwatch.snapshots.looptime import LoopTime
from gpuwatch.snapshots.prepare import Preparation, Prepared
from gpuwatch.snapshots.restore import (
    Candidate,
    candidates,
    header_of,
    like,
    localize,
    map_state,
    read_state,
    read_to_device,
)
from gpuwatch.snapshots.slot import Slot, SlotHeader
from gpuwatch.snapshots.staged import Layout, LayoutChanged, StagedJob, Stager, layout_of, tensor_ptrs
from gpuwatch.trainer import tensorfile
from gpuwatch.trainer.checkpoint import latest_step, load_latest, save_checkpoint, save_flat_buffer

log = logging.getLogger("gpuwatch.snapshots")

AUTO_WARMUP_STEPS = 3
"""With every="auto": step intervals measured before the first snapshot (its cost is judged against them)."""


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
        self._every = parse_every(every)
        self._auto = self._every is None
        self.share, self.max_every = share, max_every
        choose_every(1.0, 1.0, share=share, max_every=max_every)  # validates both
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
        self._optimizers = _as_list(optimizer)
        self._hooks = [opt.register_step_pre_hook(self._before_update) for opt in self._optimizers]
        self._dir_fd: int | None = None
        try:
            self._dir_fd = open_job_dir(self.root, self.job_id)
        except SnapshotDirError as exc:
            self._disable(str(exc))
        self._slots: dict[int, Slot] = {}
        self._job: CopyJob | StagedJob | None = None
        self._stager: Stager | None = None  # the staged mode's buffer, stream and drain thread
        self._layout: Layout | None = None  # the state's layout, reused while its tensors are the same ones
        self._preparation: Preparation | None = None
        self._window = False  # the set-up window: snapshots go into the slots as mapped (see _usable)
        self._replace_all = False  # the next preparation makes new files for both slots (the state outgrew them)
        self._prepared: Prepared | None = None
        self._renames: dict[int, str] = {}
        self._seq = self._max_seq() + 1
        self._base: int | None = None  # the step this process resumed from (None: not told yet)
        self._last_snap_step: int | None = None
        self._time = LoopTime()  # the loop's step intervals: what snapshots cost its wall time
        self._wall_floor = 0  # with "auto": the least K the measured wall-time share allows
        self._cuda: int | None = None
        self._aliased: int | None = None  # the own slot the restored state is a mapping of
        self._disk_lock = threading.Lock()
        self._disk_thread: threading.Thread | None = None
        self._disk_slot: int | None = None
        self._disk_error: BaseException | None = None
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
        self.last_cost_s: float | None = None
        self.last_host_s: float | None = None
        self.auto_basis: tuple[float, float] | None = None  # with "auto": (cost_s, step_s) it chose K from
        self.mode: str | None = None  # how a snapshot leaves the GPU (prepare.py); None until prepared

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
        found = self._candidates(at_least)
        by_step: dict[int, list[Candidate]] = {}
        for candidate in found:
            by_step.setdefault(candidate.header.step, []).append(candidate)
        for step in common_steps(by_step):
            state, where, mapped = self._read_one(by_step.get(step, []), device)
            if everyone(state is not None):
                self._aliased = mapped.slot if mapped is not None else None  # never to be written in place again
                self._resumed(step)
                if like_state is not None:
                    state = like(state, like_state)
                seconds = time.perf_counter() - started
                log.info("restored step %d from host memory (%s) in %.2f s", step, where, seconds)
                return Restored(step, state, "memory", where, seconds)
        return None

    def _candidates(self, at_least: int | None) -> list[Candidate]:
        if not self.enabled or self._dir_fd is None:
            return []
        found = candidates(self._dir_fd, rank=self.rank, world_size=self.world_size, replicated=self.replicated)
        return [c for c in found if at_least is None or c.header.step >= at_least]

    def _read_one(self, options: list[Candidate], device: Any) -> tuple[Any, str, Candidate | None]:
        """The state of the first option that verifies; where it was; the own slot it is mapped from (else None)."""
        dir_fd = self._dir_fd
        on_gpu = device is not None and str(device).startswith("cuda")
        for candidate in options:
            assert dir_fd is not None
            own = candidate.rank == self.rank and not on_gpu
            if on_gpu:
                state, reason = read_to_device(dir_fd, candidate, device)
            else:
                state, reason = map_state(dir_fd, candidate) if own else read_state(dir_fd, candidate)
            if state is not None:
                return state, str(self.directory / candidate.name), candidate if own else None
            log.warning("host snapshot %s (step %d) not used: %s", candidate.name, candidate.header.step, reason)
        return None, "", None

    def resumed_from(self, step: int | None) -> None:
        """Say which step the job resumed from when it loaded the state itself (resume() does this)."""
        self._resumed(step)

    def _resumed(self, step: int | None) -> None:
        """Snapshots of steps after `step` belong to a run that was abandoned: never load them."""
        self._base = step or 0
        self._last_snap_step = self._base
        for k in SLOTS:
            header = self._own_header(k)
            if header is None or header.step <= self._base:
                continue
            if k in self._renames:  # the slot's file, not the new one waiting under the temp name
                assert self._dir_fd is not None
                stale = Slot(self._dir_fd, slot_name(self.rank, k))
                stale.invalidate()
                stale.close()
            else:
                self._slot(k).invalidate()

    # -- the training loop's side ---------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Call after each step's update with the step just finished; every K steps it starts a snapshot.

        The first call sets the slots up on a thread (prepare.py); snapshots start once they are ready.
        A snapshot in flight drains to the host over the next steps; the next one due waits for its
        commit, so the newest committed snapshot is never more than K steps behind the boundary of
        the one in flight. The step intervals seen here, with and without a snapshot in flight, are
        what a snapshot costs the loop (stats(), and "auto"'s choice of K).
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        self._on_step(step, now)
        if self._job is not None:  # this call's time lands in the next interval, the job's: host_s says how much
            self._job.host_s += time.perf_counter() - now

    def _on_step(self, step: int, now: float) -> None:
        interval = self._time.tick(now)
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
            self._time.record(interval, in_flight=job is not None)
            if job is not None:
                job.intervals.append(interval)
        if job is not None and job.committed.is_set():
            self._finish(job)
        elif isinstance(job, StagedJob):
            job.advance(self._drain_budget())
        if self._due(step):
            if self._job is not None and self._job.window:
                return  # a set-up window's drain (pageable) is not waited for: the next starts once it commits
            if self._job is not None:  # K below the drain's floor: wait for the previous commit
                self._finish(self._job)
            if self.enabled:
                self._start(step)
                if isinstance(self._job, StagedJob):
                    self._job.advance(self._drain_budget())

    def _drain_budget(self) -> int:
        """Bytes the staged drain may queue this step (Stager.budget): a share of the plain step's time."""
        assert self._stager is not None
        return self._stager.budget(self._time.median_plain_step(recent=64))

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

    @property
    def every(self) -> int | None:
        """Steps between snapshots: as given, or as chosen by "auto" (None until its first snapshot is measured)."""
        return self._every

    def _before_update(self, *_: Any) -> None:
        """The optimizer's step pre-hook: the update must not change what a copy in flight still reads."""
        job = self._job
        if job is not None and not job.released:
            job.release_for_update()

    def ready(self, *, wait: bool = False) -> bool:
        """Whether the slots (and the GPU staging) are set up; the first call starts that, on a thread.

        `step` calls it; call it yourself (wait=True) to have them before the loop starts, once the
        state exists (after the optimizer's first step, or the restore). False: not yet, or snapshots are off.
        """
        if self._prepared is not None:
            return self.enabled
        if not self.enabled:
            return False
        if self._preparation is None:
            self._prepare()
        preparation = self._preparation
        if preparation is None or not (wait or preparation.done):
            return False
        self._adopt(preparation.join())
        return self.enabled

    def _usable(self) -> bool:
        """Whether a snapshot can be taken now: the slots are set up, or (the set-up window) they are mapped.

        In the window a snapshot goes through the path that needs no pinned slot (CopyJob: staged on
        the GPU when there was room, else device-to-host into pageable memory; on the CPU as always),
        into the slots as mapped, holding the slot's gate while it writes: the slot's registration pauses
        for it, and the K bound holds from the first step.
        """
        if self.ready():
            return True
        preparation = self._preparation
        if not self.enabled or preparation is None:
            return False
        if not self._window:
            self._take_slots(preparation.result)
            self._window = True
            self.mode = preparation.result.mode
        return self.enabled

    def _take_slots(self, prepared: Prepared) -> None:
        """Use the slots prepared (closing those they replace)."""
        for k, slot in self._slots.items():
            if prepared.slots.get(k) is not slot:
                slot.close()
        self._slots = dict(prepared.slots)
        self._renames = dict(prepared.renames)

    def _prepare(self) -> None:
        """Lay the state out (references only) and start preparing slots and staging for its size."""
        assert self._dir_fd is not None
        try:
            flat = tensorfile.plan(localize(self._state_fn()))
            if flat is None:
                self._disable("the state holds values a flat tensor file cannot (custom objects, sparse tensors)")
                return
            cuda = _cuda_device(flat)
        except (OSError, ValueError) as exc:
            self._disable(f"cannot keep the state in {self.directory}: {exc}")
            return
        replace = set(SLOTS) if self._replace_all else {self._aliased} if self._aliased is not None else set()
        self._replace_all = False
        self._cuda, self.state_bytes = cuda, flat.size
        self._preparation = Preparation(self._dir_fd, self.rank, flat.size, cuda, staging=self._staging_wanted,
                                        replace=replace, budget=self.gpu_budget)  # fmt: skip

    def _adopt(self, prepared: Prepared) -> None:
        """Take the prepared slots over, or turn snapshots off (one line) when they could not be made."""
        self._prepared = prepared
        if prepared.error is not None:
            for slot in prepared.slots.values():
                slot.close()
            error = prepared.error
            self._disable(f"cannot keep the state in {self.directory}: {type(error).__name__}: {error}")
            return
        if not self._window:
            self._take_slots(prepared)
        self._window = False
        self.setup_s += prepared.seconds
        self.ready_step = self._step_now
        self.ready_s = time.perf_counter() - self._first_t if self._first_t is not None else prepared.seconds
        self.mode = prepared.mode
        if prepared.mode == "staged" and prepared.pinned and self._cuda is not None:
            self._stager = Stager(prepared.staging, self._cuda)
        staged = 0 if prepared.staging is None else int(prepared.staging.numel())
        host = "pinned" if prepared.pinned else "pageable" if self._cuda is not None else "host"
        gpu = f", {_size(staged)} of GPU memory for staging" if staged else ""
        mapped = max((slot.map_s for slot in self._slots.values()), default=0.0)
        log.info("host snapshots of %s: mode %s%s, %s slots in %s, ready in %.2f s (filled in %.2f s; set up off "
                 "the training thread)", _size(self.state_bytes), prepared.mode, gpu, host, self.directory,
                 prepared.seconds, mapped)  # fmt: skip

    def _due(self, step: int) -> bool:
        if self._every is None and not self._window:
            return self._job is None and self._time.plain_steps >= AUTO_WARMUP_STEPS
        every = self._every or self.max_every  # "auto" in the set-up window: its largest K keeps the bound
        last = self._last_snap_step if self._last_snap_step is not None else 0
        return step - last >= every

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
            if cuda != self._cuda or any(slot.payload_capacity < flat.size for slot in self._slots.values()):
                self._set_up_again(flat.size)  # the new slots are usable at once (the set-up window)
                if not self._usable() or any(s.payload_capacity < flat.size for s in self._slots.values()):
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
        self._last_snap_step = step
        self._job = job
        if not self._optimizers:
            job.release_for_update()  # nothing tells us before the state changes: the copy completes now

    def _copy_job(self, step: int, slot: Slot, flat: tensorfile.FlatState, cuda: int | None) -> CopyJob:
        """A CopyJob; in the set-up window it holds the slot's gate (its registration pauses) until its commit."""
        gate = slot.gate if self._window else None
        if gate is not None:
            gate.acquire()  # waits for one registered piece at most (milliseconds)
        try:
            return CopyJob(step, self._seq, slot, flat, self._owned(flat), cuda, self.world_size, self.rank,
                           self._staging(), gate=gate)  # fmt: skip
        except BaseException:
            if gate is not None:
                gate.release()
            raise

    def _staging(self) -> Any:
        """The GPU staging buffer (also in the set-up window), or None."""
        prepared = self._prepared or (self._preparation.result if self._window and self._preparation else None)
        return prepared.staging if prepared is not None else None

    def _set_up_again(self, nbytes: int) -> None:
        """The state outgrew the slots (or moved): new ones are set up off the training thread, under temp names
        so that the committed snapshots stay loadable meanwhile; snapshots resume once they are ready."""
        log.info("host snapshot state is now %s: setting its slots up again, off the training thread", _size(nbytes))
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._prepared is not None:
            self._prepared.staging = None  # the GPU memory goes back before the new buffer is taken
        self._prepared, self._preparation, self._layout = None, None, None
        self._replace_all, self._window = True, False
        self.ready()

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
        layout = layout_of(flat, self._owned(flat), ptrs)
        self._layout = layout if planned <= set(ptrs) else None  # a copied (non-contiguous) tensor: plan each time
        return layout, None

    def _target(self, nbytes: int, cuda: int | None) -> Slot:
        """The slot the next snapshot goes into, sized for `nbytes` (see _target_slot)."""
        k = self._target_slot()
        if k in self._renames:  # the new file prepared for the restored slot takes its name now
            assert self._dir_fd is not None
            os.rename(self._renames.pop(k), slot_name(self.rank, k), src_dir_fd=self._dir_fd,
                      dst_dir_fd=self._dir_fd)  # fmt: skip
            self._slot(k).name = slot_name(self.rank, k)
            if k == self._aliased:
                self._aliased = None
        if k == self._aliased:
            self._replace_slot(k)
        slot = self._slot(k)
        setup_s = 0.0 if self._window else slot.ensure(nbytes, pin=cuda is not None)  # the window: as mapped
        if setup_s:
            log.info("host snapshot slot %s: %s in %s, set up in %.2f s", slot.name, _size(nbytes), self.directory,
                     setup_s)  # fmt: skip
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
        cost = self._time.snapshot_done(job.intervals, job.host_s, job.worker_s)
        every = self._every
        if cost is not None:
            self.last_cost_s, self.last_host_s = cost, job.host_s
            if self._auto:
                self._choose_every()
        if self.snapshots == 1 or every != self._every:
            log.info("%s", self.describe())

    def describe(self) -> str:
        """One line: the mode, the GPU memory it takes, the cadence and the steps a death may lose."""
        bound = self.loss_bound()
        every = f"every {self._every} step(s)" if self._every else "K not chosen yet"
        lose = "?" if bound is None or not self._every else f"{bound} ({self._every} + {bound - self._every} of drain)"
        return (f"host snapshots of {_size(self.state_bytes)}: mode {self.mode}, {_size(self.gpu_bytes())} of GPU "
                f"memory, {every}; a death with no survivor loses at most {lose} steps")  # fmt: skip

    def loss_bound(self) -> int | None:
        """Steps a death with no survivor loses at most: K, plus the steps a snapshot's drain spans (the one in
        flight is not committed yet). None until a snapshot was measured."""
        step_s, drain_s = self._time.plain_step(), self._time.median_drain()
        if not self._every or not step_s or drain_s is None:
            return None
        return self._every + math.ceil(drain_s / step_s)

    def gpu_bytes(self) -> int:
        """The GPU memory the snapshots hold between snapshots (the staging buffer)."""
        staging = self._staging()
        return 0 if staging is None else int(staging.numel())

    def _choose_every(self) -> None:
        """ "auto": the K that keeps what snapshots cost the loop's wall time under the share (looptime.py)."""
        step_s, cost_s = self._time.median_plain_step(), self._time.mean_cost()
        assert step_s is not None and cost_s is not None
        drain_s = self._time.median_drain() or 0.0
        every = choose_every(max(0.0, cost_s), step_s, share=self.share, max_every=self.max_every,
                             background_s=drain_s)  # fmt: skip
        measured = self._time.wall_share()
        if (
            self._every
            and measured is not None
            and measured > self.share
            and self._time.since_restart >= 3 * self._every
        ):
            self._wall_floor = min(self.max_every, math.ceil(self._every * measured / self.share))
        every = max(every, self._wall_floor)  # a K the wall time showed too short is not chosen again
        self.auto_basis = (max(0.0, cost_s), step_s)
        if every != self._every:
            log.info(
                "host snapshot of %s costs the loop %.4f s per snapshot (%d measured) of a %.4f s step, drains in "
                "%.3f s: every %d step(s) keeps it under %g %%",
                _size(self.state_bytes), cost_s, len(self._time.costs), step_s, drain_s, every, self.share * 100,
            )  # fmt: skip
            self._time.restart_window()
        self._every = every

    def _target_slot(self) -> int:
        """The slot not holding the newest commit (nor being written to disk: then wait for that write)."""
        headers = {k: self._own_header(k) for k in SLOTS}
        target = min(SLOTS, key=lambda k: headers[k].seq if headers[k] is not None else -1)  # type: ignore[union-attr]
        if self._disk_slot == target:
            self._join_disk()
        return target

    def _owned(self, flat: tensorfile.FlatState) -> list[bool]:
        """For each source: is it a tensor the optimizers update (copied directly, their update waits)?"""
        if not self._optimizers:
            return [True] * len(flat.sources)
        torch = sys.modules["torch"]
        owned: set[tuple[str, int]] = set()
        for opt in self._optimizers:
            tensors = [p for group in opt.param_groups for p in group["params"]]
            tensors += [v for per_param in opt.state.values() for v in per_param.values()]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    local = localize(tensor)
                    owned.add((str(local.device), local.untyped_storage().data_ptr()))
        return [(str(s.device), s.untyped_storage().data_ptr()) in owned for s in flat.sources]

    # -- disk checkpoints from the snapshot -----------------------------------------------------------

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
        self._join_disk()
        job = self._job if self._job is not None and self._job.step == step else None
        k = None if job is not None else self._committed_slot(step)
        if job is None and k is None and self._usable():  # K does not divide the checkpoint cadence
            if self._job is not None:
                self._finish(self._job)
            if self.enabled:
                self._start(step)  # a snapshot of this step now; the disk write waits for its commit
                job = self._job
        if job is not None:
            k = next(key for key, slot in self._slots.items() if slot is job.slot)
        if k is None:
            save_checkpoint(directory, step, self._state_fn(), keep=keep, single_writer=True)
            return
        self._disk_slot = k
        thread = threading.Thread(
            target=self._write_disk_in_background, args=(Path(directory), step, k, keep, job),
            name="gpuwatch-snapshot-ckpt", daemon=True,
        )  # fmt: skip
        self._disk_thread = thread
        thread.start()
        if wait:
            self._join_disk()

    def rescue(self, directory: str | os.PathLike[str], last: int) -> Path:
        """A survivor's rescue (TrainerLink.rescue's save): commit `last` in host memory, then write it to disk.

        The host commit takes a device-to-host copy (seconds at most); a relaunch on this node resumes
        from it even if torchrun kills the rank before the disk write ends. The disk write goes from the
        host snapshot at the disk's speed, as a single writer (any survivor may write the same step).

        Raises:
            CheckpointError: the checkpoint could not be written.
        """
        try:
            self._join_disk()
        except CheckpointError as exc:  # an earlier background write's failure must not stop the rescue
            log.error("%s", exc)
        if self._slot_of(last) is None:
            self.snapshot_now(last)
        k = self._slot_of(last)
        if k is None:  # snapshots off or failed: serialise from the state as before
            return save_checkpoint(directory, last, self._state_fn(), single_writer=True)
        return self._write_disk(Path(directory), last, k, 3, True)

    def _slot_of(self, step: int) -> int | None:
        """The slot holding the committed snapshot of `step` (waiting for it when it is in flight), else None."""
        if not self.enabled:
            return None
        if self._job is not None and self._job.step == step:
            self._finish(self._job)
        return self._committed_slot(step)

    def _committed_slot(self, step: int) -> int | None:
        """The slot holding the committed snapshot of `step`, else None (no waiting)."""
        if not self.enabled:
            return None
        for k in SLOTS:
            header = self._own_header(k)
            if header is not None and header.step == step:
                return k
        return None

    def _write_disk(self, directory: Path, step: int, k: int, keep: int, single_writer: bool) -> Path:
        """Write the committed snapshot in slot `k` as the checkpoint of `step` (one disk writer at a time)."""
        slot = self._slot(k)
        header = slot.header()
        if header is None or header.step != step or slot.map is None:
            raise CheckpointError(f"the host snapshot of step {step} was replaced before it was written to disk")
        ranges = [(c.offset, c.length) for c in header.chunks()]
        with self._disk_lock:
            path = save_flat_buffer(directory, step, slot.payload_view(header.payload_len), ranges, keep=keep,
                                    single_writer=single_writer)  # fmt: skip
        log.info("checkpoint of step %d written from host memory: %s", step, path)
        return path

    def _write_disk_in_background(
        self, directory: Path, step: int, k: int, keep: int, job: CopyJob | StagedJob | None
    ) -> None:
        try:
            if job is not None:  # the snapshot of `step` is still draining: write once it is committed
                job.committed.wait()
                if job.error is not None:
                    raise CheckpointError(f"the host snapshot of step {step} failed: {job.error}")
            self._write_disk(directory, step, k, keep, False)
        except BaseException as exc:  # reported by the training thread at the next checkpoint or at close
            self._disk_error = exc
        finally:
            self._disk_slot = None

    def _join_disk(self) -> None:
        """Wait for the background checkpoint; raise its failure (CheckpointError) once."""
        thread, self._disk_thread = self._disk_thread, None
        if thread is not None:
            thread.join()
        error, self._disk_error = self._disk_error, None
        if error is not None:
            raise CheckpointError(f"background checkpoint from host memory failed: {error}") from error

    # -- lifecycle ------------------------------------------------------------------------------------

    def close(self, *, remove: bool) -> None:
        """Wait for what is in flight, then release the slots; `remove` deletes them (the job is finished).

        Idempotent. A rank that stops for resume or fails keeps them (remove=False) for the relaunch.
        """
        try:
            if self._job is not None and self.enabled:
                self._finish(self._job)
            self._join_disk()
            if self._preparation is not None and self._prepared is None:
                self._adopt(self._preparation.join())  # its slots are closed below
        except Exception as exc:  # at exit, perhaps after another error (a lost GPU): say it, do not mask that one
            log.error("host snapshot of rank %s at close: %s: %s", self.rank, type(exc).__name__, exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._layout = None
            for slot in self._slots.values():
                slot.close()
            self._slots = {}
            if self._prepared is not None:
                self._prepared.staging = None  # the GPU memory goes back to the caching allocator
                for name in self._renames.values():
                    with contextlib.suppress(OSError):
                        assert self._dir_fd is not None
                        os.unlink(name, dir_fd=self._dir_fd)
                self._renames = {}
            if remove and self._dir_fd is not None:
                self._remove_slots()
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
                if remove:
                    remove_job_dir(self.root, self.job_id)

    def _remove_slots(self) -> None:
        """This rank's slots; rank 0 also those of ranks a larger world left behind."""
        assert self._dir_fd is not None
        for name in os.listdir(self._dir_fd):
            parsed = parse_slot_name(name)
            if parsed is None:
                continue
            if parsed[0] == self.rank or (self.rank == 0 and parsed[0] >= self.world_size):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir_fd)

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
        mean_cost = self._time.mean_cost()
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "directory": str(self.directory),
            "every": self._every,
            "snapshots": self.snapshots,
            "window_snapshots": self.window_snapshots,
            "committed_step": self.committed_step,
            "state_bytes": self.state_bytes,
            "host_bytes": 2 * self.state_bytes,
            "setup_s": self.setup_s,
            "ready_step": self.ready_step,
            "ready_s": self.ready_s,
            "mode": self.mode,
            "pinned": bool(self._prepared and self._prepared.pinned),
            "staging_bytes": staged,
            "gpu_bytes": self.gpu_bytes(),
            "gpu_budget": self._prepared.budget.limit if self._prepared and self._prepared.budget else self.gpu_budget,
            "gpu_budget_why": self._prepared.budget.why if self._prepared and self._prepared.budget else None,
            "loss_bound_steps": self.loss_bound(),
            "copy_s": self.last_copy_s,
            "drain_s": self._time.median_drain(),
            "cost_s": self.last_cost_s,
            "host_s": self.last_host_s,
            "mean_host_s": self._time.mean_host(),
            "mean_cost_s": mean_cost,
            "step_s": self._time.plain_step(),
            "cost_share": self._time.wall_share(),
            "device": "cpu" if self._cuda is None else f"cuda:{self._cuda}",
            "auto_basis": self.auto_basis,
        }

    # -- helpers --------------------------------------------------------------------------------------

    def _disable(self, reason: str) -> None:
        if self.enabled:
            log.warning("host snapshots off for rank %s of job %s: %s; resuming from the disk", self.rank,
                        self.job_id, reason)  # fmt: skip
        self.enabled = False
        self.disabled_reason = reason
        self._job = None

    def _slot(self, k: int) -> Slot:
        slot = self._slots.get(k)
        if slot is None:
            assert self._dir_fd is not None
            slot = self._slots[k] = Slot(self._dir_fd, slot_name(self.rank, k))
        return slot

    def _replace_slot(self, k: int) -> None:
        """Unlink slot k's file (the restored state is a private mapping of it) so the next write gets a new one."""
        assert self._dir_fd is not None
        slot = self._slots.pop(k, None)
        if slot is not None:
            slot.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot_name(self.rank, k), dir_fd=self._dir_fd)
        self._aliased = None

    def _own_header(self, k: int) -> SlotHeader | None:
        if not self.enabled or self._dir_fd is None:
            return None
        if k in self._slots and k not in self._renames:
            return self._slots[k].header()
        return header_of(self._dir_fd, slot_name(self.rank, k))  # (a new file waits under its temp name)

    def _max_seq(self) -> int:
        return max((h.seq for h in (self._own_header(k) for k in SLOTS) if h is not None), default=0)


def _cuda_device(flat: tensorfile.FlatState) -> int | None:
    """The CUDA device of the state's tensors (None: all on the CPU); one device per rank."""
    devices = {s.device.index for s in flat.sources if s.device.type == "cuda"}
    if len(devices) > 1:
        raise ValueError(f"the state is on several CUDA devices {sorted(devices)}: one rank, one device")
    return int(devices.pop() or 0) if devices else None


def _as_list(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if isinstance(optimizer, Iterable) and not hasattr(optimizer, "param_groups"):
        return list(optimizer)
    return [optimizer]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"
