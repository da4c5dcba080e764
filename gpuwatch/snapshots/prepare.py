"""Setting a rank's snapshots up once, off the training thread: both host slots, pinned, and the GPU staging buffer.

Sizing a slot (fallocate), mapping it with its pages populated, and registering it with CUDA walk
every page of it: seconds per GiB under a sandbox's memory manager (an H200 in gVisor: 8.6 s to map
16 GiB, 0.7 s to register it). Done at the first snapshot, that landed on the step; here it runs on
its own thread from the first `HostSnapshot.step`, and snapshots start once it is done (a state
under 128 MiB is set up at once, in milliseconds). Each slot is sized and populated in pieces with
pauses between them (Slot.ensure: mmap's MAP_POPULATE held the GIL for the whole page walk, so the
training thread stood still), both before either is registered: a registration waits for a page
walk in progress while it holds the driver's lock, and every CUDA call of the job waits with it (a
step stalled 12.8 s so on the H200); and a registration goes in pieces too (Slot._pin).

The mode says how a CUDA snapshot leaves the GPU (staged.py, copier.py):

* "staged": the whole state fits a staging buffer on the GPU: the optimizer waits only for a
  device-to-device copy; the drain to the host runs over the following steps;
* "partial": the GPU had room for part of it: that part is staged, the rest goes device-to-host
  from the tensors, and the optimizer waits for that part (PCIe speed);
* "direct": no room (or staging=False): everything goes device-to-host before the update;
* "cpu": the state is on the CPU, copied on a thread.

The staging buffer is taken from the GPU memory free after the first step, less a headroom (the
larger of 2 GiB and 5 % of the GPU), so it does not take what the job's next steps need; a budget
caps it further (budget.py: HostSnapshot's gpu_budget, 0 turns staging off; by default, under a
launcher that keeps standbys of the job, what leaves a standby's room).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.snapshots.budget import StagingBudget, headroom, staging_budget
from gpuwatch.snapshots.layout import SLOTS, slot_name
from gpuwatch.snapshots.slot import HEADER_LEN, Slot

MIN_STAGING = 64 << 20  # below this a staging buffer saves too little of the wait to be worth the memory
_ALIGN = 2 << 20
TEMP = ".tmp"
PREPARE_INLINE_BELOW = 128 << 20  # a smaller state is set up on the training thread (milliseconds)


@dataclass
class Prepared:
    """What the preparation made: the slots, the staging buffer, the mode, how long it took (or why it failed)."""

    slots: dict[int, Slot] = field(default_factory=dict)
    renames: dict[int, str] = field(default_factory=dict)  # slot -> the temp name its new file has until used
    staging: Any = None
    mode: str = "cpu"
    pinned: bool = False
    seconds: float = 0.0
    error: BaseException | None = None
    budget: StagingBudget | None = None  # the most GPU memory staging could take, and why (None: a CPU state)


class Preparation:
    """Prepares the slots (and staging) for a state of `nbytes`: usable at once, set up on a thread; `done` says when.

    The constructor (on the training thread, milliseconds) checks /dev/shm has room for both slots,
    sizes and maps them sparse (Slot.map_sparse) and sets the staging budget: `result` holds the
    slots from then on, so a CPU state's snapshots can be taken during the set-up window
    (HostSnapshot). The thread takes the staging buffer (one cudaMalloc of the state's size, off the
    training thread), then fills and pins the slots in pieces.

    Args:
        dir_fd: the job directory.
        rank: this rank (the slots' names).
        nbytes: the state's flat size.
        cuda: the CUDA device of the state, or None.
        staging: whether to stage on the GPU at all.
        budget: the most GPU memory (bytes) staging may take; None: the default (budget.staging_budget).
        replace: slots whose files must be replaced, not reused (a restored state is a mapping of them):
            a new file is made under the temp name, and the old one keeps its snapshot until the new one
            takes its name (HostSnapshot, when it first writes that slot).
    """

    def __init__(
        self,
        dir_fd: int,
        rank: int,
        nbytes: int,
        cuda: int | None,
        *,
        staging: bool,
        replace: set[int],
        budget: int | None = None,
    ) -> None:
        self.nbytes, self.cuda, self.budget = nbytes, cuda, budget
        self.result = Prepared()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-snapshot-prepare", daemon=True)
        self._map(dir_fd, rank, staging, replace)
        if self.result.error is not None:
            return
        if nbytes < PREPARE_INLINE_BELOW:
            self._run()  # milliseconds: done before the first snapshot is due
        else:
            self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> Prepared:
        if self._thread.ident is not None:
            self._thread.join()
        return self.result

    def _map(self, dir_fd: int, rank: int, staging: bool, replace: set[int]) -> None:
        """The usable part, at once: both slots sized and mapped sparse, and the staging budget."""
        result = self.result
        try:
            for k in SLOTS:
                name = slot_name(rank, k)
                if k in replace:  # a new file under the temp name; it takes the slot's name when first written
                    name += TEMP
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
                    result.renames[k] = name
                result.slots[k] = Slot(dir_fd, name)
            check_room(dir_fd, self.nbytes, list(result.slots.values()))
            for slot in result.slots.values():
                slot.map_sparse(self.nbytes)
            if self.cuda is not None:
                off = StagingBudget(0, "staging=False")
                result.budget = staging_budget(self.budget, self.cuda) if staging else off
        except BaseException as exc:  # reported by the training thread: snapshots off, one line
            result.error = exc
            result.seconds = time.perf_counter() - self._started

    def _allocate(self) -> None:
        """A CUDA state's staging buffer within the budget, and the mode it gives."""
        result = self.result
        if self.cuda is None:
            return
        if result.budget is not None and result.budget.limit != 0:
            result.staging = allocate_staging(self.nbytes, self.cuda, budget=result.budget.limit)
        result.mode = mode_of(self.nbytes, result.staging)

    def _run(self) -> None:
        result = self.result
        try:
            self._allocate()
            paced = self._thread.ident is not None  # on its own thread: in pieces, the training thread between
            for slot in result.slots.values():
                slot.fill(paced=paced)
            if self.cuda is not None:  # after the page walks: registering during one stalled the job's CUDA calls
                for slot in result.slots.values():
                    slot.pin()
            result.pinned = all(slot.pinned for slot in result.slots.values())
        except BaseException as exc:  # reported by the training thread: snapshots off, one line
            result.error = exc
        result.seconds = time.perf_counter() - self._started


def check_room(dir_fd: int, nbytes: int, slots: list[Slot]) -> None:
    """Raise ENOSPC unless the file system has room for every slot at `nbytes` (what they hold counts as room):
    a snapshot written into a sparse slot before its fill must not meet a full /dev/shm (SIGBUS)."""
    st = os.fstatvfs(dir_fd)
    room = st.f_bavail * st.f_frsize + sum(slot.allocated() for slot in slots)
    need = len(slots) * (HEADER_LEN + nbytes)
    if room < need:
        raise OSError(errno.ENOSPC, f"{need} bytes wanted for the slots, {room} free", "/dev/shm")


def mode_of(nbytes: int, staging: Any) -> str:
    """The mode for a CUDA state of `nbytes` with this staging buffer (see the module doc)."""
    capacity = 0 if staging is None else int(staging.numel())
    return "staged" if capacity >= nbytes else "partial" if capacity else "direct"


def allocate_staging(
    nbytes: int,
    device: int,
    *,
    budget: int | None = None,
    free_bytes: Callable[[int], tuple[int, int]] | None = None,
) -> Any:
    """A uint8 buffer on `device` of up to `nbytes` (what fits under the headroom and the budget), or None when
    too little fits."""
    torch = sys.modules["torch"]
    free, total = (free_bytes or torch.cuda.mem_get_info)(device)
    room = free - headroom(total)
    if budget is not None:
        room = min(room, budget)
    want = min(_round_up(nbytes), room // _ALIGN * _ALIGN)
    with torch.cuda.device(device):
        while want >= MIN_STAGING:
            try:
                return torch.empty(want, dtype=torch.uint8, device=f"cuda:{device}")
            except torch.cuda.OutOfMemoryError:
                want = want // 2 // _ALIGN * _ALIGN
    return None


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
