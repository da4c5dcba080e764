"""One rank's two slot files in the job's directory: which holds what, and the files that replace them.

A slot whose file the restored state maps (restore.py) is never written in place again: its name is
unlinked and a new file made. A slot set up again while its committed snapshot must stay loadable
waits under a temp name (prepare.py) and takes the slot's name when the next snapshot goes into it.
Locking: none; only the training thread calls it (the preparation thread hands its new slots over
through `take`, and the disk writer reads a slot only while it is not the next snapshot's target).
"""

from __future__ import annotations

import contextlib
import os

from gpuwatch.snapshots.layout import SLOTS, names_in, parse_slot_name, slot_name
from gpuwatch.snapshots.prepare import Prepared
from gpuwatch.snapshots.restore import header_of
from gpuwatch.snapshots.slot import Slot, SlotHeader


class RankSlots:
    """The rank's slots in the job directory `dir_fd` (None: the directory could not be opened)."""

    def __init__(self, dir_fd: int | None, rank: int) -> None:
        self.dir_fd = dir_fd
        self.rank = rank
        self.slots: dict[int, Slot] = {}
        self.renames: dict[int, str] = {}  # slot -> the temp name its new file waits under
        self.aliased: int | None = None  # the own slot the restored state is a mapping of

    def slot(self, k: int) -> Slot:
        """Slot k, opened on first use."""
        slot = self.slots.get(k)
        if slot is None:
            assert self.dir_fd is not None
            slot = self.slots[k] = Slot(self.dir_fd, slot_name(self.rank, k))
        return slot

    def header(self, k: int) -> SlotHeader | None:
        """Slot k's committed header (of the slot's file: a new file waits under its temp name), else None."""
        if self.dir_fd is None:
            return None
        if k in self.slots and k not in self.renames:
            return self.slots[k].header()
        return header_of(self.dir_fd, slot_name(self.rank, k))

    def newest_seq(self) -> int:
        """The highest sequence number committed in either slot (0: none)."""
        return max((h.seq for h in (self.header(k) for k in SLOTS) if h is not None), default=0)

    def oldest(self) -> int:
        """The slot not holding the newest commit."""
        headers = {k: self.header(k) for k in SLOTS}
        return min(SLOTS, key=lambda k: headers[k].seq if headers[k] is not None else -1)  # type: ignore[union-attr]

    def holding(self, step: int) -> int | None:
        """The slot whose committed snapshot is of `step`, else None."""
        for k in SLOTS:
            header = self.header(k)
            if header is not None and header.step == step:
                return k
        return None

    def invalidate_after(self, base: int) -> None:
        """Invalidate the committed snapshots of steps after `base` (an abandoned run's)."""
        for k in SLOTS:
            header = self.header(k)
            if header is None or header.step <= base:
                continue
            if k in self.renames:  # the slot's file, not the new one waiting under the temp name
                assert self.dir_fd is not None
                stale = Slot(self.dir_fd, slot_name(self.rank, k))
                stale.invalidate()
                stale.close()
            else:
                self.slot(k).invalidate()

    def take(self, prepared: Prepared) -> None:
        """Use the slots prepared (closing those they replace)."""
        for k, slot in self.slots.items():
            if prepared.slots.get(k) is not slot:
                slot.close()
        self.slots = dict(prepared.slots)
        self.renames = dict(prepared.renames)

    def claim(self, k: int) -> Slot:
        """Slot k, ready to be written: a new file waiting under a temp name takes the slot's name, and a
        slot the restored state maps is replaced by a new file."""
        if k in self.renames:
            assert self.dir_fd is not None
            os.rename(self.renames.pop(k), slot_name(self.rank, k), src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            self.slot(k).name = slot_name(self.rank, k)
            if k == self.aliased:
                self.aliased = None
        if k == self.aliased:
            self._replace(k)
        return self.slot(k)

    def _replace(self, k: int) -> None:
        """Unlink slot k's file (the restored state is a private mapping of it) so the next write gets a new one."""
        assert self.dir_fd is not None
        slot = self.slots.pop(k, None)
        if slot is not None:
            slot.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot_name(self.rank, k), dir_fd=self.dir_fd)
        self.aliased = None

    def close(self, *, drop_renames: bool) -> None:
        """Release the slots; `drop_renames`: also unlink the new files still waiting under temp names."""
        for slot in self.slots.values():
            slot.close()
        self.slots = {}
        if drop_renames:
            for name in self.renames.values():
                with contextlib.suppress(OSError):
                    assert self.dir_fd is not None
                    os.unlink(name, dir_fd=self.dir_fd)
            self.renames = {}

    def remove_files(self, world_size: int) -> None:
        """This rank's slot files; rank 0 also those of ranks a larger world left behind."""
        assert self.dir_fd is not None
        for name in names_in(self.dir_fd):
            parsed = parse_slot_name(name)
            if parsed is None:
                continue
            if parsed[0] == self.rank or (self.rank == 0 and parsed[0] >= world_size):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)

    def close_dir(self) -> None:
        """Close the job directory (idempotent)."""
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None
