"""The staged snapshot of a CUDA state: a device-to-device copy at the boundary, drained a portion per step.

At the boundary (`StagedJob(...)`, on the training thread, while the GPU waits for the loop's next
launches) the state's CUDA tensors are copied into the staging buffer on a side stream that first
waits for the compute stream, one copy per tensor; the optimizer's next update waits for that copy
on the GPU (`release_for_update`), never on the host. Tiny CPU tensors (an optimizer's step counts)
are copied into the host slot there and then.

The staging buffer then drains into the pinned host slot a portion per step: `advance`, called by
`HostSnapshot.step` right after the loop's step, queues whole 16 MiB chunks worth about DRAIN_SHARE
of a plain step at the measured device-to-host rate, and nothing while the previous portion is still
copying. The copy engine serves device-to-host copies in the order they are queued, so a loop's own
copy (`loss.item()` at the end of its step) would wait behind a drain queued before it: sized so, a
portion is done before the step that follows it ends. The first portion goes at the step after the
boundary: queued at the boundary it waited behind the device-to-device copy on the side stream and
ended after that step's own copy (on an H100 at 16 GiB the step after each boundary took 16 ms
more, 111 ms against 95, and at DRAIN_SHARE 1.0 52 ms more). The copies are issued on the training
thread (a handful a step: more Python elsewhere would hold the GIL the training thread needs to
launch its next step).

One thread per rank (Stager) waits for each portion's copy, checksums its chunks on the crc pool,
writes the structure, and commits the slot after the last portion. A state whose layout was reused
from an earlier snapshot (HostSnapshot keeps it while the state's tensors are the same ones) is
planned again on that thread, once the first portion is done (the training thread is then waiting
for its own step): if the layout differs, the snapshot is dropped (LayoutChanged) and the next one
is planned afresh.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.errors import SnapshotError
from gpuwatch.snapshots.copier import die_if_asked, side_stream
from gpuwatch.snapshots.copier import pool as crc_pool
from gpuwatch.snapshots.cudacopy import StreamCopier
from gpuwatch.snapshots.slot import Slot, chunk_size_for
from gpuwatch.trainer import tensorfile
from gpuwatch.trainer.tensorfile import FlatState

DRAIN_SHARE = 0.6
"""The share of a plain step one drain portion may take on the copy engine (the rest is the step's own)."""
FIRST_RATE = 24 << 30
"""Bytes per second a device-to-host portion is assumed to move before one has been measured."""


class LayoutChanged(SnapshotError):
    """The state's layout at the boundary was not the one reused for the copy: the snapshot is dropped."""


@dataclass
class Layout:
    """A state's flat layout, planned once and reused while its tensors are the same ones (HostSnapshot).

    What each snapshot of it needs is worked out here once (the chunks, where the drain's copies are cut):
    at 16 GiB, making them again at each boundary and each step of the drain held the training thread
    while the GPU waited for its next launches.
    """

    flat: FlatState
    owned: list[bool]  # for each source: does an optimizer own it (else it is cloned at the boundary)
    ptrs: list[int]  # the state's tensors' addresses, in order: the cheap check that the layout still holds
    runs: list[tuple[int, int]]  # the payload ranges drained from the staging buffer (all but CPU tensors)
    chunk: int  # the slot's chunk size for this payload, and its chunks (chunk 0: the structure)
    chunks: list[tuple[int, int]]
    _pieces: list[tuple[int, int]] | None = field(default=None, repr=False)  # `runs` cut as a pinned slot is
    _starts: list[int] = field(default_factory=list, repr=False)  # each piece's offset (bisected)

    def drain_copies(self, slot: Slot, start: int, end: int) -> list[tuple[int, int]]:
        """The (offset, length) copies that drain payload [start, end): its bytes in `runs`, cut where one
        registered piece of a pinned slot ends (every pinned slot is cut at the same places: once per layout)."""
        if self._pieces is None:
            self._pieces = [span for a, b in self.runs for span in slot.spans(a, b - a)]
            self._starts = [at for at, _ in self._pieces]
        copies, i = [], max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._pieces) and self._pieces[i][0] < end:
            at, n = self._pieces[i]
            a, b = max(at, start), min(at + n, end)
            if a < b:
                copies.append((a, b - a))
            i += 1
        return copies


def layout_of(flat: FlatState, owned: list[bool], ptrs: list[int]) -> Layout:
    """The layout of `flat`, with the payload ranges its staging buffer drains (all but its CPU tensors' bytes)."""
    cpu = sorted((r.offset, r.offset + r.nbytes) for r, s in zip(flat.records, flat.sources, strict=True)
                 if s.device.type == "cpu" and r.nbytes)  # fmt: skip
    runs, pos = [], flat.data_off
    for start, end in cpu:
        if start > pos:
            runs.append((pos, start))
        pos = max(pos, end)
    if pos < flat.size:
        runs.append((pos, flat.size))
    chunk = chunk_size_for(flat.size)
    return Layout(flat, owned, ptrs, runs, chunk, tensorfile.chunk_ranges(flat.data_off, flat.size, chunk))


def tensor_ptrs(state: Any) -> list[int]:
    """The address of each tensor in `state` (a DTensor's local shard), in order: cheaper than planning it."""
    torch = sys.modules["torch"]
    out: list[int] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "device_mesh") else value
            out.append(local.data_ptr())
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(state)
    return out


@dataclass
class _Portion:
    job: StagedJob
    begin: Any  # CUDA events around its copies (timed: the drain's rate)
    end: Any
    first: int  # chunk indices [first, stop)
    stop: int
    nbytes: int


class Stager:
    """What one rank's staged snapshots share: the staging buffer, the side stream, the measured drain rate,
    and the thread that checksums and commits each snapshot."""

    def __init__(self, staging: Any, device: int) -> None:
        torch = sys.modules["torch"]
        self.staging, self.device = staging, device
        self.stream = side_stream(torch, device)
        self.copier = StreamCopier(self.stream) if torch.cuda.current_device() == device else None
        self.rate = float(FIRST_RATE)
        self.layout: Layout | None = None  # what the staging buffer is laid out for (its padding is zero)
        self._queue: queue.SimpleQueue[_Portion | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="gpuwatch-snapshot-drain", daemon=True)
        self._thread.start()

    def budget(self, step_s: float | None) -> int:
        """Bytes one portion may drain in a step of `step_s` (one chunk when the step is not known yet)."""
        return max(1, int(DRAIN_SHARE * step_s * self.rate)) if step_s else 1

    def submit(self, portion: _Portion) -> None:
        self._queue.put(portion)

    def close(self) -> None:
        self._queue.put(None)

    def _serve(self) -> None:
        while (portion := self._queue.get()) is not None:
            portion.job._drained(portion)


class StagedJob:
    """The staged snapshot of one step into one slot, from the boundary to its commit (see the module doc).

    Args:
        step, seq, slot, world_size, rank: as CopyJob's.
        layout: the state's layout (its sources are the tensors to copy now).
        stager: the rank's staging buffer (at least the state's size), stream and drain thread.
        replan: when the layout was reused, plans the boundary's state again (compared off the step).
    """

    def __init__(
        self,
        step: int,
        seq: int,
        slot: Slot,
        layout: Layout,
        stager: Stager,
        world_size: int,
        rank: int,
        replan: Callable[[], FlatState | None] | None = None,
    ) -> None:
        torch = sys.modules["torch"]
        self.step, self.seq, self.slot, self.layout = step, seq, slot, layout
        self.stager, self.world_size, self.rank = stager, world_size, rank
        self._replan = replan
        self.copied = threading.Event()
        self.committed = threading.Event()
        self.error: BaseException | None = None
        self.released = False
        self.window = False  # staged snapshots start once the slots are set up (pinned)
        self.started = time.perf_counter()
        self.worker_s = self.copy_s = self.drain_s = 0.0
        self.intervals: list[float] = []  # the loop's step intervals while it was in flight (HostSnapshot.step)
        self.host_s = 0.0  # the training thread's time inside HostSnapshot.step for this snapshot
        flat = layout.flat
        self._next = 1  # the next chunk to drain (0 is the structure, written on the host)
        self._last: Any = None  # the end event of the portion queued last
        self._pending: list[tuple[list[int], Any]] = []  # chunk indices and the crc task computing theirs
        self._view = slot.payload_view(flat.size)
        slot.begin()
        sources = [s if own else s.clone() for s, own in zip(flat.sources, layout.owned, strict=True)]
        host = slot.payload_address()
        for record, source in zip(flat.records, sources, strict=True):
            if source.device.type == "cpu" and record.nbytes:
                ctypes.memmove(host + record.offset, source.data_ptr(), record.nbytes)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(stager.device))
        stream, staging = stager.stream, stager.staging
        stream.wait_event(ready)
        if stager.layout is not layout:  # another layout: padding must read as zeros, as in the file
            with torch.cuda.stream(stream):
                staging[flat.data_off : flat.size].zero_()
            stager.layout = layout
        base = staging.data_ptr()
        for record, source in zip(flat.records, sources, strict=True):
            if record.nbytes and source.device.type != "cpu":
                fallback = functools.partial(_torch_copy, stream, record.nbytes, staging, record.offset, source, 0)
                self._copy(base + record.offset, source.data_ptr(), record.nbytes, fallback)
        self._sources = sources  # clones stay alive until the copy is done (the drain thread drops them)
        self._done = torch.cuda.Event()
        self._done.record(stream)
        self.copied.set()
        if len(self.layout.chunks) == 1:  # no tensor bytes: nothing drains, the structure is still written
            self._last = self._done
            stager.submit(_Portion(self, self._done, self._done, 1, 1, 0))

    # -- the training thread's side ---------------------------------------------------------------

    def release_for_update(self) -> None:
        """Before the optimizer updates in place: the compute stream waits for the staging copy (not the host)."""
        if not self.released:
            torch = sys.modules["torch"]
            torch.cuda.current_stream(self.stager.device).wait_event(self._done)
            self.released = True

    def advance(self, budget: int) -> None:
        """Queue the next portion of the drain: whole chunks, at least one, about `budget` bytes (0: all the rest).

        Nothing while the previous portion is still copying (a step shorter than measured must not pile
        portions up in front of the loop's own copies).
        """
        chunks = self.layout.chunks
        if self._next >= len(chunks) or self.error is not None:
            return
        if budget and self._last is not None and not self._last.query():
            return
        torch = sys.modules["torch"]
        first, stop, nbytes = self._next, self._next, 0
        while stop < len(chunks) and (not budget or nbytes < budget or stop == first):
            nbytes += chunks[stop][1]
            stop += 1
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = self.stager.stream
        host, base = self.slot.payload_address(), self.stager.staging.data_ptr()
        begin.record(stream)
        start, end = chunks[first][0], chunks[stop - 1][0] + chunks[stop - 1][1]
        for at, n in self.layout.drain_copies(self.slot, start, end):
            self._copy(host + at, base + at, n, functools.partial(self._torch_drain, at, n))
        done.record(stream)
        self._next, self._last = stop, done
        self.stager.submit(_Portion(self, begin, done, first, stop, nbytes))

    def _copy(self, dst: int, src: int, nbytes: int, fallback: Callable[[], None]) -> None:
        """Queue a copy of `nbytes` from address `src` to `dst` on the side stream; `fallback` does the same
        through torch, where the runtime cannot be called."""
        if self.stager.copier is None:
            fallback()
        else:
            self.stager.copier.copy(dst, src, nbytes, fallback)

    def _torch_drain(self, at: int, nbytes: int) -> None:
        payload = self.slot.payload_tensor(0, self.layout.flat.size)
        _torch_copy(self.stager.stream, nbytes, payload, at, self.stager.staging, at)

    def wait_committed(self, timeout: float | None = None) -> None:
        """Queue whatever is left of the drain at once, then wait for the commit (or the failure)."""
        self.advance(0)
        self.committed.wait(timeout)

    # -- the drain thread ---------------------------------------------------------------------------

    def _drained(self, portion: _Portion) -> None:
        """A portion was queued: once its copy is done, checksum its chunks; after the last, commit."""
        try:
            if self.error is None:
                portion.end.synchronize()  # releases the GIL
                self._measure(portion)
                if portion.first == 1:
                    self._sources = []
                    self._write_structure()
                self._checksum(portion.first, portion.stop)
            if portion.stop == len(self.layout.chunks) or self.error is not None:
                self._commit()
        except BaseException as exc:  # reported by the training thread at the next boundary
            self.error = exc
            self._end()

    def _measure(self, portion: _Portion) -> None:
        self.copy_s = self.drain_s = time.perf_counter() - self.started
        if portion.nbytes >= 4 * self.layout.chunk:
            elapsed_ms = portion.begin.elapsed_time(portion.end)
            if elapsed_ms > 0:
                self.stager.rate = portion.nbytes / (elapsed_ms / 1e3)

    def _write_structure(self) -> None:
        """The structure (chunk 0) as planned for the boundary's state; a reused layout is checked first."""
        flat = self.layout.flat
        if self._replan is not None:
            now = self._replan()
            if now is None or not _same_layout(flat, now):
                raise LayoutChanged(f"the state's layout changed before the snapshot of step {self.step}")
            flat = now
        self.slot.write_prefix(flat.prefix)
        self._pending.append(([0], crc_pool().submit(_crcs, self._view, self.layout.chunks[:1])))

    def _checksum(self, first: int, stop: int) -> None:
        """The chunks [first, stop) on the crc pool, a few tasks of several chunks (little Python, little GIL)."""
        pool = crc_pool()
        n = max(1, min(tensorfile.workers(), stop - first))
        for k in range(n):
            indices = list(range(first + k, stop, n))
            ranges = [self.layout.chunks[i] for i in indices]
            self._pending.append((indices, pool.submit(_crcs, self._view, ranges)))

    def _commit(self) -> None:
        if self.error is None:
            crcs = [0] * len(self.layout.chunks)
            for indices, task in self._pending:
                for i, crc in zip(indices, task.result(), strict=True):
                    crcs[i] = crc
            flat = self.layout.flat
            self.slot.commit(
                step=self.step, seq=self.seq, payload_len=flat.size, data_off=flat.data_off, chunk=self.layout.chunk,
                crcs=crcs, world_size=self.world_size, rank=self.rank, before_commit=lambda: die_if_asked(self.step),
            )  # fmt: skip
        self._end()

    def _end(self) -> None:
        if self.error is not None:  # portions still queued may write into the slot: the next job waits for them
            self.stager.stream.synchronize()
        self._view.release()
        self._sources = []
        self.worker_s = time.perf_counter() - self.started
        self.committed.set()


def _torch_copy(stream: Any, nbytes: int, dst: Any, dst_at: int, src: Any, src_at: int) -> None:
    with sys.modules["torch"].cuda.stream(stream):
        dst[dst_at : dst_at + nbytes].copy_(src[src_at : src_at + nbytes], non_blocking=True)


def _crcs(view: memoryview, ranges: Sequence[tuple[int, int]]) -> list[int]:
    return [tensorfile.crc32(view[offset : offset + length]) for offset, length in ranges]


def _same_layout(a: FlatState, b: FlatState) -> bool:
    """Whether `b` puts the same tensors (the same storage) at the same places as `a`."""
    return (
        a.data_off == b.data_off
        and a.size == b.size
        and a.records == b.records
        and [s.data_ptr() for s in a.sources] == [s.data_ptr() for s in b.sources]
    )
