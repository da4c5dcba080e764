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

Every K steps `step()` starts copying the state into the older of the rank's two slots (copier.py)
and returns; the copy runs beside the next step's forward and backward, the optimizer's update
waits for it, and the next `step()` waits for its commit, so a death with no survivor loses at most
K steps. `every="auto"` takes the first snapshot after three steps, measures what it cost the step
and picks the K that keeps it under 1 % (cadence.py). A relaunch on the same node restores the
newest step every rank holds (agree.py), verified chunk by chunk, before it reads the disk.

The slots are removed when the job finishes (the context exits without an error); a rank that
stops for resume or dies leaves them for the relaunch, and the daemon prunes a dead job's slots
after a grace period (prune.py). A reboot clears /dev/shm. What lives where: layout.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
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
from gpuwatch.snapshots.restore import Candidate, candidates, header_of, like, localize, map_state, read_state
from gpuwatch.snapshots.slot import Slot, SlotHeader
from gpuwatch.trainer import tensorfile
from gpuwatch.trainer.checkpoint import latest_step, load_latest, save_checkpoint, save_flat_buffer

log = logging.getLogger("gpuwatch.snapshots")

AUTO_WARMUP_STEPS = 3
"""With every="auto": step intervals measured before the first snapshot (its cost is judged against them)."""
_INTERVALS = 50


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

    Raises:
        ValueError: every is neither a positive integer nor "auto", or there is no job id.
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
    ) -> None:
        self._state_fn = state
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
        self._job: CopyJob | None = None
        self._unmeasured: list[CopyJob] = []
        self._seq = self._max_seq() + 1
        self._base: int | None = None  # the step this process resumed from (None: not told yet)
        self._last_snap_step: int | None = None
        self._first_started = False
        self._last_t: float | None = None
        self._plain: deque[float] = deque(maxlen=_INTERVALS)  # step intervals with no snapshot in flight
        self._costs: deque[float] = deque(maxlen=_INTERVALS)
        self._cuda: int | None = None
        self._aliased: int | None = None  # the own slot the restored state is a mapping of
        self._disk_lock = threading.Lock()
        self._disk_thread: threading.Thread | None = None
        self._disk_slot: int | None = None
        self._disk_error: BaseException | None = None
        self.snapshots = 0
        self.committed_step: int | None = None
        self.state_bytes = 0
        self.setup_s = 0.0
        self.last_copy_s: float | None = None
        self.last_cost_s: float | None = None
        self.auto_basis: tuple[float, float] | None = None  # with "auto": (cost_s, step_s) it chose K from

    # -- resuming -----------------------------------------------------------------------------------

    def resume(self, checkpoint_dir: str | os.PathLike[str], *, like_state: Any = None) -> Restored | None:
        """The host snapshot when every rank has one at least as new as the disk's newest, else `load_latest`.

        All ranks call it (it agrees with the others). None when neither has anything.

        Args:
            checkpoint_dir: the checkpoint directory to fall back to.
            like_state: for sharded state, a state of the same structure (get_state_dict's): its DTensors'
                meshes and placements turn the restored local shards back into DTensors.

        Raises:
            CheckpointError: the disk has checkpoints and none verifies (as load_latest).
        """
        started = time.perf_counter()
        restored = self.restore(like_state=like_state, at_least=latest_step(checkpoint_dir))
        if restored is not None:
            return restored
        loaded = load_latest(checkpoint_dir)
        self._resumed(loaded.step if loaded is not None else None)
        if loaded is None:
            return None
        seconds = time.perf_counter() - started
        return Restored(loaded.step, loaded.state, "disk", str(loaded.path), seconds, loaded.skipped)

    def restore(self, *, like_state: Any = None, at_least: int | None = None) -> Restored | None:
        """The newest host snapshot every rank holds (at least step `at_least`), verified; None if there is none.

        All ranks call it: it is collective when there are several, also on a rank whose snapshots are off.
        """
        started = time.perf_counter()
        found = self._candidates(at_least)
        by_step: dict[int, list[Candidate]] = {}
        for candidate in found:
            by_step.setdefault(candidate.header.step, []).append(candidate)
        for step in common_steps(by_step):
            state, where, mapped = self._read_one(by_step.get(step, []))
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

    def _read_one(self, options: list[Candidate]) -> tuple[Any, str, Candidate | None]:
        """The state of the first option that verifies; where it was; the own slot it is mapped from (else None)."""
        dir_fd = self._dir_fd
        for candidate in options:
            assert dir_fd is not None
            own = candidate.rank == self.rank
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
            if header is not None and header.step > self._base:
                self._slot(k).invalidate()

    # -- the training loop's side ---------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Call after each step's update with the step just finished; every K steps it starts a snapshot.

        It waits for the previous snapshot's commit (usually long done), so the newest committed
        snapshot is never more than K steps behind.
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        interval = now - self._last_t if self._last_t is not None else None
        self._last_t = now
        if self._base is None:
            self._resumed(step - 1)
        if self._job is not None:
            self._finish(self._job)
        elif interval is not None:
            self._plain.append(interval)
        self._measure()
        if self._due(step):
            self._start(step)

    def wait(self) -> None:
        """Wait until the snapshot in flight (if any) is committed."""
        if self._job is not None:
            self._finish(self._job)

    def snapshot_now(self, step: int) -> bool:
        """Take a snapshot of `step` and wait for its commit; False when snapshots are off or it failed."""
        if not self.enabled:
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

    def _due(self, step: int) -> bool:
        if self._every is None:
            return not self._first_started and len(self._plain) >= AUTO_WARMUP_STEPS
        last = self._last_snap_step if self._last_snap_step is not None else 0
        return step - last >= self._every

    def _start(self, step: int) -> None:
        started = time.perf_counter()
        try:
            flat = tensorfile.plan(localize(self._state_fn()))
            if flat is None:
                self._disable("the state holds values a flat tensor file cannot (custom objects, sparse tensors)")
                return
            cuda = _cuda_device(flat)
            k = self._target_slot()
            if k == self._aliased:
                self._replace_slot(k)
            slot = self._slot(k)
            setup_s = slot.ensure(flat.size, pin=cuda is not None)
            if setup_s:
                log.info("host snapshot slot %s: %s in %s, set up in %.2f s", slot.name, _size(flat.size),
                         self.directory, setup_s)  # fmt: skip
            self.setup_s += setup_s
            job = CopyJob(step, self._seq, slot, flat, self._owned(flat), cuda, self.world_size, self.rank)
        except (OSError, ValueError) as exc:
            self._disable(f"cannot keep the state in {self.directory}: {exc}")
            return
        self._seq += 1
        self._cuda, self.state_bytes = cuda, flat.size
        self._first_started = True
        self._last_snap_step = step
        self._job = job
        job.blocked_s += time.perf_counter() - started - setup_s
        if not self._optimizers:
            job.release_for_update()  # nothing tells us before the state changes: the copy completes now

    def _finish(self, job: CopyJob) -> None:
        job.release_for_update()
        job.wait_committed()
        self._job = None
        if job.error is not None:
            self._disable(f"the snapshot of step {job.step} failed: {type(job.error).__name__}: {job.error}")
            return
        self.snapshots += 1
        self.committed_step = job.step
        self.last_copy_s = job.copy_s
        self._unmeasured.append(job)

    def _measure(self) -> None:
        """Costs of committed snapshots whose GPU stall is known by now; with "auto", the cadence from the first."""
        for job in list(self._unmeasured):
            if not job.measure_stall():
                continue
            self._unmeasured.remove(job)
            self.last_cost_s = job.cost_s
            self._costs.append(job.cost_s)
            if self._every is None:
                step_s = statistics.median(self._plain) if self._plain else 0.0
                if job.cuda is not None:  # the copy runs off the step: its commit wait only counts at a short cadence
                    cost_s, background_s = job.cost_s - job.commit_wait_s, job.worker_s
                else:  # on the CPU the copier competes with the training for cores: its whole time is the cost
                    cost_s, background_s = job.cost_s, 0.0
                self._every = choose_every(
                    cost_s, step_s, share=self.share, max_every=self.max_every, background_s=background_s
                )
                self.auto_basis = (cost_s, step_s)
                log.info(
                    "host snapshot of %s costs %.3f s of a %.3f s step: every %d step(s) keeps it under %g %%",
                    _size(self.state_bytes), job.cost_s, step_s, self._every, self.share * 100,
                )  # fmt: skip

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
        k = self._slot_of(step)
        if k is None and self.snapshot_now(step):  # K does not divide the checkpoint cadence: one copy now
            k = self._slot_of(step)
        if k is None:
            save_checkpoint(directory, step, self._state_fn(), keep=keep, single_writer=True)
            return
        self._disk_slot = k
        thread = threading.Thread(
            target=self._write_disk_in_background, args=(Path(directory), step, k, keep),
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

    def _write_disk_in_background(self, directory: Path, step: int, k: int, keep: int) -> None:
        try:
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
        except Exception as exc:  # at exit, perhaps after another error (a lost GPU): say it, do not mask that one
            log.error("host snapshot of rank %s at close: %s: %s", self.rank, type(exc).__name__, exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            for slot in self._slots.values():
                slot.close()
            self._slots = {}
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
        """What the snapshots cost and hold, for logs and the bench."""
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "directory": str(self.directory),
            "every": self._every,
            "snapshots": self.snapshots,
            "committed_step": self.committed_step,
            "state_bytes": self.state_bytes,
            "host_bytes": 2 * self.state_bytes,
            "setup_s": self.setup_s,
            "copy_s": self.last_copy_s,
            "cost_s": self.last_cost_s,
            "mean_cost_s": statistics.fmean(self._costs) if self._costs else None,
            "step_s": statistics.median(self._plain) if self._plain else None,
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
        if k in self._slots:
            return self._slots[k].header()
        return header_of(self._dir_fd, slot_name(self.rank, k))

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
