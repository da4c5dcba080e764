"""Where the set-up of one rank's slots stands: not started, under way (the set-up window), or done.

The first `HostSnapshot.step` starts a Preparation (prepare.py) on its own thread; until its result
is adopted, a CPU state's snapshots go into its slots as mapped (the window; a CUDA state's wait).
When the state outgrows the slots, the set-up starts again and makes new files for both. Locking:
none; only the training thread reads or changes it, and the preparation's thread hands its result
over through `Preparation.join`.
"""

from __future__ import annotations

from typing import Any

from gpuwatch.snapshots.layout import SLOTS
from gpuwatch.snapshots.prepare import Preparation, Prepared


class SlotSetup:
    """The preparation under way, its adopted result, and whether snapshots run in the set-up window."""

    def __init__(self) -> None:
        self.preparation: Preparation | None = None
        self.prepared: Prepared | None = None  # the result HostSnapshot adopted: the set-up is done
        self.window = False  # the set-up window (a CPU state): snapshots go into the slots as mapped
        self.replace_all = False  # the next preparation makes new files for both slots (the state outgrew them)

    def start(
        self, dir_fd: int, rank: int, nbytes: int, cuda: int | None, *, staging: bool, aliased: int | None,
        budget: int | None,
    ) -> None:  # fmt: skip
        """Prepare slots (and staging) for `nbytes`, on a thread; a slot the restored state maps gets a new file."""
        replace = set(SLOTS) if self.replace_all else {aliased} if aliased is not None else set()
        self.replace_all = False
        self.preparation = Preparation(dir_fd, rank, nbytes, cuda, staging=staging, replace=replace, budget=budget)

    def staging(self) -> Any:
        """The GPU staging buffer once the set-up is done, or None (a CUDA state's snapshots wait for that)."""
        return self.prepared.staging if self.prepared is not None else None

    @property
    def pinned(self) -> bool:
        """Whether the adopted slots are registered with CUDA (pinned)."""
        return bool(self.prepared and self.prepared.pinned)

    def release_staging(self) -> None:
        """Give the staging buffer's GPU memory back to the caching allocator."""
        if self.prepared is not None:
            self.prepared.staging = None

    def again(self) -> None:
        """Start over (the state outgrew the slots, or moved): new files for both, the GPU memory given back first."""
        self.release_staging()
        self.prepared, self.preparation = None, None
        self.replace_all, self.window = True, False
