"""Disk checkpoints written from a committed host snapshot, on one background thread at a time.

`HostSnapshot.checkpoint` starts a write here and goes on training; `rescue` writes on the calling
thread. Locking: `lock` lets one write at a time reach the disk (a rescue's and a background one);
the training thread alone starts and joins the thread; the writer thread sets `error` and clears
`slot` as it ends, and the training thread reads `error` only after the join (`slot` is only ever
cleared: a stale value costs one join).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from gpuwatch.errors import CheckpointError
from gpuwatch.snapshots.slot import Slot
from gpuwatch.trainer.checkpoint import save_flat_buffer

log = logging.getLogger("gpuwatch.snapshots")


class DiskWriter:
    """Writes snapshots to disk; at most one in the background, whose failure the next `join` raises."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.slot: int | None = None  # the slot the background write reads
        self.error: BaseException | None = None

    def write(self, slot: Slot, directory: Path, step: int, *, keep: int, single_writer: bool) -> Path:
        """Write the committed snapshot in `slot` as the checkpoint of `step` (one disk writer at a time)."""
        header = slot.header()
        if header is None or header.step != step or slot.map is None:
            raise CheckpointError(f"the host snapshot of step {step} was replaced before it was written to disk")
        ranges = [(c.offset, c.length) for c in header.chunks()]
        with self.lock:
            path = save_flat_buffer(directory, step, slot.payload_view(header.payload_len), ranges, keep=keep,
                                    single_writer=single_writer)  # fmt: skip
        log.info("checkpoint of step %d written from host memory: %s", step, path)
        return path

    def start(self, k: int, write: Callable[[], object]) -> None:
        """Run `write` (which reads slot `k`) on the background thread; its failure is kept for `join`."""
        self.slot = k
        thread = threading.Thread(target=self._run, args=(write,), name="gpuwatch-snapshot-ckpt", daemon=True)
        self.thread = thread
        thread.start()

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as exc:  # reported by the training thread at the next checkpoint or at close
            self.error = exc
        finally:
            self.slot = None

    def join(self) -> None:
        """Wait for the background checkpoint; raise its failure (CheckpointError) once."""
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise CheckpointError(f"background checkpoint from host memory failed: {error}") from error
