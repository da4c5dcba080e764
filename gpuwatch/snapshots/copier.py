"""One snapshot in flight: copy the state into a slot off the training thread, checksum it, commit it.

The state's tensors are copied where they live, while the next step's forward and backward run
(a staged snapshot into a pinned slot is staged.py's: its copies are issued on the training thread):

* CUDA, staged into a slot CUDA would not pin: on a side stream that first waits for the compute
  stream at the step boundary, each tensor is copied device-to-device into a staging buffer on the
  same GPU. Before the optimizer updates the parameters in place, the compute stream waits for that
  copy only (a GPU-side wait: the host does not block); the staging buffer then drains into the
  host slot on this thread, one 16 MiB chunk queued at a time (the copy engine serves
  device-to-host copies in order: the job's own, such as loss.item(), wait behind what is queued).
* CUDA, partly staged or direct: where the GPU had room for less than the whole state (staging.py),
  the bytes past the staging buffer go device-to-host from the tensors themselves, and the update
  waits for those too (PCIe speed).
* CPU: a background thread copies (torch's copies release the GIL); the optimizer's update waits
  for it on the host.

Tensors the optimizer does not own (buffers such as BatchNorm's running stats, which the forward
updates in place) are cloned at the boundary, on their device, and copied from the clone. The copy
goes chunk by chunk (16 MiB), each chunk's crc32 computed on a pool of threads as soon as its bytes
are in, so the checksums end shortly after the copy; then the copier commits the slot.

Test-only hook: with GPUWATCH_SNAPSHOT_TEST_DIE_BEFORE_COMMIT=<step> in the environment, the
process SIGKILLs itself after the snapshot of that step is copied and checksummed, just before its
slot's commit: the torn slot a death mid-copy leaves. Never set it outside a test.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpuwatch.snapshots.slot import Slot, chunk_size_for
from gpuwatch.trainer import tensorfile
from gpuwatch.trainer.tensorfile import FlatState

if TYPE_CHECKING:
    import torch

DIE_BEFORE_COMMIT_ENV = "GPUWATCH_SNAPSHOT_TEST_DIE_BEFORE_COMMIT"
DRAIN_DEPTH = 1  # chunks (16 MiB) queued: what a copy of the job's waits behind (0.3 ms at 51 GiB/s)


class CopyJob:
    """The snapshot of one step into one slot, from the boundary to its commit.

    Args:
        step: the step the state belongs to.
        seq: this rank's snapshot sequence number (the slot with the higher one is the newer).
        slot: where it goes (already sized for flat.size).
        flat: the state's layout; its sources are the tensors to copy.
        owned: for each source, whether the optimizer owns it (copied directly) or it must be cloned now.
        cuda: the CUDA device the sources are on, or None for the CPU path.
        world_size, rank: recorded in the slot's header.
        staging: a uint8 buffer on the CUDA device (payload bytes [0, its size) go through it), or None.
        window: taken in the set-up window (a CPU state's, into its slot as mapped): its steps say nothing
            of a snapshot's cost.
    """

    def __init__(
        self,
        step: int,
        seq: int,
        slot: Slot,
        flat: FlatState,
        owned: Sequence[bool],
        cuda: int | None,
        world_size: int,
        rank: int,
        staging: torch.Tensor | None = None,
        window: bool = False,
    ) -> None:
        self.step, self.seq, self.slot, self.flat = step, seq, slot, flat
        self.window = window
        self.staging = staging if cuda is not None else None
        self.cuda, self.world_size, self.rank = cuda, world_size, rank
        self.copied = threading.Event()  # CPU: the copies are done; CUDA: issued (done_event says when done)
        self.committed = threading.Event()
        self.error: BaseException | None = None
        self.released = False  # the optimizer's update may run (it waited for the copy)
        self.worker_s = 0.0  # the copier's time, from the boundary to the commit
        self.copy_s = 0.0
        self.drain_s = 0.0  # from the boundary until the last byte was in the host slot
        self.started = time.perf_counter()
        self.intervals: list[float] = []  # the loop's step intervals while it was in flight (HostSnapshot.step)
        self.host_s = 0.0  # the training thread's time inside HostSnapshot.step for this snapshot
        self._done_event: Any = None
        self._sources: list[torch.Tensor] = []
        self._in_flight: collections.deque[Any] = collections.deque()  # drain copies queued (their events)
        self._prepare(owned)
        self._thread = threading.Thread(target=self._run, name=f"gpuwatch-snapshot-{step}", daemon=True)
        self._thread.start()

    # -- the training thread's side ---------------------------------------------------------------

    def _prepare(self, owned: Sequence[bool]) -> None:
        """At the boundary: clone what the optimizer does not own; on CUDA copy CPU tensors now, mark the stream."""
        torch = sys.modules["torch"]
        self.slot.begin()
        self._sources = [s if own else s.clone() for s, own in zip(self.flat.sources, owned, strict=True)]
        if self.cuda is None:
            return
        for record, source in zip(self.flat.records, self._sources, strict=True):
            if source.device.type == "cpu" and record.nbytes:
                self.slot.payload_tensor(record.offset, record.nbytes).copy_(source)
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.cuda))

    def release_for_update(self) -> None:
        """Before the optimizer updates in place: wait for the copy (CUDA: the compute stream waits, not the host)."""
        if self.released:
            return
        self.copied.wait()
        if self.cuda is not None and self._done_event is not None:
            torch = sys.modules["torch"]
            torch.cuda.current_stream(self.cuda).wait_event(self._done_event)
        self.released = True

    def wait_committed(self, timeout: float | None = None) -> None:
        """Wait for the commit (or the failure)."""
        self.committed.wait(timeout)

    # -- the copier thread --------------------------------------------------------------------------

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            crcs = self._copy_and_checksum()
            self._commit(crcs)
        except BaseException as exc:  # reported by the training thread at the next boundary
            self.error = exc
        finally:
            self._sources = []
            self.copied.set()
            self.worker_s = time.perf_counter() - started
            self.committed.set()

    def _copy_and_checksum(self) -> list[int]:
        """Copy chunk by chunk; each chunk's crc32 runs on the pool as soon as its bytes are in (pipelined).

        With a staging buffer the chunks it covers are first copied device-to-device (the release point
        for the optimizer), then drained to the host; the chunks past it go device-to-host directly,
        before the release point.
        """
        torch = sys.modules["torch"]
        started = time.perf_counter()
        self._chunk = chunk_size_for(self.flat.size)
        ranges = tensorfile.chunk_ranges(self.flat.data_off, self.flat.size, self._chunk)
        spans = [(r.offset, r.nbytes, s) for r, s in zip(self.flat.records, self._sources, strict=True) if r.nbytes]
        staged_end = self._staged_end(ranges)
        view = self.slot.payload_view(self.flat.size)
        crc_pool = pool()
        self.slot.write_prefix(self.flat.prefix)
        futures: dict[int, Any] = {0: crc_pool.submit(_crc, view, ranges[0], None)}
        context = torch.cuda.device(self.cuda) if self.cuda is not None else contextlib.nullcontext()
        with context:
            stream = side_stream(torch, self.cuda) if self.cuda is not None else None
            if stream is not None:
                stream.wait_event(self._ready)
                self._stage(torch, stream, staged_end)
            for i, (offset, length) in enumerate(ranges[1:], 1):
                if offset + length > staged_end:
                    ready = self._copy_range(torch, stream, spans, offset, length)
                    futures[i] = crc_pool.submit(_crc, view, (offset, length), ready)
            if stream is not None:
                self._done_event = torch.cuda.Event()
                self._done_event.record(stream)
            self.copied.set()  # the optimizer may update once the GPU is past _done_event
            if staged_end:
                with torch.cuda.stream(stream):  # one stream switch for the whole drain (each costs the GIL)
                    for i, (offset, length) in enumerate(ranges[1:], 1):
                        if offset + length <= staged_end:
                            ready = self._drain_chunk(torch, spans, offset, length)
                            futures[i] = crc_pool.submit(_crc, view, (offset, length), ready)
            results = [futures[i].result() for i in range(len(ranges))]
        self.drain_s = max(t for _, t in results) - self.started
        self.copy_s = time.perf_counter() - started
        return [crc for crc, _ in results]

    def _staged_end(self, ranges: list[tuple[int, int]]) -> int:
        """The payload offset up to which the chunks go through the staging buffer (0: none do)."""
        if self.staging is None:
            return 0
        capacity = self.staging.numel()
        end = 0
        for offset, length in ranges[1:]:
            if offset + length > capacity:
                break
            end = offset + length
        return end

    def _stage(self, torch: Any, stream: Any, staged_end: int) -> None:
        """Device-to-device: each CUDA tensor's bytes below `staged_end` into the staging buffer, one copy each."""
        if not staged_end or self.staging is None:
            return
        with torch.cuda.stream(stream):
            for record, source in zip(self.flat.records, self._sources, strict=True):
                if record.nbytes and source.device.type != "cpu" and record.offset < staged_end:
                    n = min(record.nbytes, staged_end - record.offset)
                    self.staging[record.offset : record.offset + n].copy_(source[:n], non_blocking=True)

    def _copy_range(self, torch: Any, stream: Any, spans: list[Any], offset: int, length: int) -> Any:
        """Copy what belongs in payload [offset, offset + length) from the sources themselves.

        On CUDA it returns the event that says when the bytes are in.
        """
        for piece in tensorfile.pieces(spans, offset, length):
            dst = self.slot.payload_tensor(offset + piece.at, piece.length)
            if piece.source is None:
                dst.zero_()  # padding: the file's bytes, so the checksum and a disk copy are the same
            elif stream is None:
                dst.copy_(piece.source[piece.start : piece.start + piece.length])
            elif piece.source.device.type != "cpu":  # CPU tensors went at the boundary (_prepare)
                with torch.cuda.stream(stream):
                    for at, n in self.slot.spans(offset + piece.at, piece.length):
                        start = piece.start + at - offset - piece.at
                        self.slot.payload_tensor(at, n).copy_(piece.source[start : start + n], non_blocking=True)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _drain_chunk(self, torch: Any, spans: list[Any], offset: int, length: int) -> Any:
        """Staging to host for payload [offset, offset + length): one copy per run of GPU bytes (one per chunk,
        mostly), at most DRAIN_DEPTH chunks queued; the event that says when the chunk is in.

        The staging buffer holds each tensor at its payload offset, so a run of adjacent tensors is
        one copy. Few, large copies keep the GIL free for the training thread (each copy issued is
        Python work); the depth bounds what the job's own device-to-host copies (loss.item()) wait
        behind, since the copy engine serves them in the order they are queued. Runs on the side
        stream (the caller's context).
        """
        assert self.staging is not None
        runs: list[list[int]] = []
        for piece in tensorfile.pieces(spans, offset, length):
            at = offset + piece.at
            if piece.source is None:
                self.slot.payload_tensor(at, piece.length).zero_()  # padding: the file's bytes
            elif piece.source.device.type != "cpu":  # CPU tensors went at the boundary (_prepare)
                if runs and runs[-1][1] == at:
                    runs[-1][1] = at + piece.length
                else:
                    runs.append([at, at + piece.length])
        while len(self._in_flight) >= DRAIN_DEPTH:
            self._in_flight.popleft().synchronize()  # releases the GIL
        for start, end in runs:
            for at, n in self.slot.spans(start, end - start):
                self.slot.payload_tensor(at, n).copy_(self.staging[at : at + n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append(event)
        return event

    def _commit(self, crcs: list[int]) -> None:
        self.slot.commit(
            step=self.step,
            seq=self.seq,
            payload_len=self.flat.size,
            data_off=self.flat.data_off,
            chunk=self._chunk,
            crcs=crcs,
            world_size=self.world_size,
            rank=self.rank,
            before_commit=lambda: die_if_asked(self.step),
        )


def die_if_asked(step: int) -> None:
    """The test-only hook of the module docstring: die between the copy and the commit of `step`."""
    if os.environ.get(DIE_BEFORE_COMMIT_ENV) == str(step):
        with contextlib.suppress(OSError):
            sys.stderr.write(f"{DIE_BEFORE_COMMIT_ENV}={step}: dying before the slot's commit\n")
            sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _crc(view: memoryview, rng: tuple[int, int], ready: Any) -> tuple[int, float]:
    """crc32 of view[offset:offset + length] once `ready` (a CUDA event, or None) says its bytes are in; and when."""
    if ready is not None:
        ready.synchronize()  # releases the GIL
    arrived = time.perf_counter()
    offset, length = rng
    return tensorfile.crc32(view[offset : offset + length]), arrived


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The checksum threads, one pool for the process (crc32 releases the GIL)."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(tensorfile.workers(), thread_name_prefix="gpuwatch-crc")
    return _POOL


_STREAMS: dict[int, Any] = {}


def side_stream(torch: Any, device: int) -> Any:
    """One copy stream per device for the life of the process (creating one per snapshot would leak)."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream
