"""Reading a rank's newest committed slot onto the GPU while its group forms, ahead of the restore that asks for it.

A process that joins a job holding no state (a standby at its hand-over, a replacement) restores from
host memory only once its group has formed: on one H100 forming it (the rendezvous, the process group,
NCCL's first communicator) took 0.3-0.7 s, and the read of 16 GiB onto the GPU 0.56-0.77 s after it.
`Prefetch` starts that read on a thread as soon as the rank knows its place. The restore (recall.py)
takes the result when it asks for the same commit (the same slot file, seq and step); for any other,
it drops the prefetched state first, so the GPU never holds two read-back states. The read is
restore.read_to_device's: every chunk verified, the slot checked unchanged after it.
"""

from __future__ import annotations

import threading
from typing import Any

from gpuwatch.snapshots.restore import Candidate, candidates, read_to_device


class Prefetch:
    """The newest committed slot this rank may load, being read onto `device` on a thread (see the module doc)."""

    def __init__(self, dir_fd: int, *, rank: int, world_size: int, replicated: bool, device: Any) -> None:
        # Listed on the calling thread: the commit read ahead is known when the constructor returns.
        try:
            found = candidates(dir_fd, rank=rank, world_size=world_size, replicated=replicated)
        except OSError:  # nothing read ahead: the restore lists the directory itself, and says what fails there
            found = []
        self.candidate: Candidate | None = found[0] if found else None
        self._result: tuple[Any, str | None] | None = None
        self._thread: threading.Thread | None = None
        if self.candidate is not None:
            self._thread = threading.Thread(
                target=self._read, args=(dir_fd, self.candidate, device), name="gpuwatch-prefetch", daemon=True
            )
            self._thread.start()

    def _read(self, dir_fd: int, candidate: Candidate, device: Any) -> None:
        try:
            self._result = read_to_device(dir_fd, candidate, device)
        except Exception as exc:  # the restore reads the slot itself then, and says why if it fails too
            self._result = (None, f"{type(exc).__name__}: {exc}")

    def take(self, candidate: Candidate) -> tuple[Any, str | None] | None:
        """The read of `candidate` (state, reason) when it is the commit prefetched, else None; waits for the read,
        and either way the prefetch holds nothing after this call."""
        mine, result = self.candidate, self._finish()
        same = mine is not None and result is not None and (mine.name, mine.header.seq, mine.header.step) == (
            candidate.name, candidate.header.seq, candidate.header.step,
        )  # fmt: skip
        return result if same else None

    def drop(self) -> None:
        """Wait for the read and let its state go (its GPU memory back to torch's cache)."""
        self._finish()

    def _finish(self) -> tuple[Any, str | None] | None:
        """Wait for the read (if one is under way); its result, which the prefetch then no longer holds."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        result, self._result = self._result, None
        return result
