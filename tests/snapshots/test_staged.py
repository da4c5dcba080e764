"""The pieces of the staged (GPU) snapshot path that run without a GPU: what drains from the staging buffer,
copies that respect the slot's registered pieces, the order the slots are set up in, and the fallback
when the CUDA runtime refuses a copy. The path itself runs on a GPU machine (tests/snapshots/test_gpu.py,
python -m gpuwatch.bench.snapshot_cost)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpuwatch.snapshots import cudacopy, prepare
from gpuwatch.snapshots.layout import open_job_dir
from gpuwatch.snapshots.slot import HEADER_LEN, PIN_PIECE, Slot, read_header
from gpuwatch.snapshots.staged import layout_of
from gpuwatch.trainer.tensorfile import FlatState, TensorRecord


def _record(offset: int, nbytes: int) -> TensorRecord:
    return TensorRecord(dtype="uint8", shape=(nbytes,), offset=offset, nbytes=nbytes)


def test_the_drain_covers_every_byte_but_the_cpu_tensors_that_went_to_the_host_at_the_boundary() -> None:
    """Padding between GPU tensors drains too (it is zero in the staging buffer): the file's bytes."""
    gpu = torch.empty(0, device="meta")  # stands in for a CUDA tensor: anything not on the CPU is staged
    cpu = torch.zeros(8, dtype=torch.uint8)
    records = [_record(8192, 5000), _record(13248, 8), _record(13312, 8), _record(16384, 4096), _record(20480, 8)]
    sources = [gpu, cpu, cpu, gpu, cpu]
    flat = FlatState(prefix=b"", records=records, sources=sources, data_off=8192, size=24576)
    runs = layout_of(flat, [True] * 5, []).runs
    assert runs == [(8192, 13248), (13256, 13312), (13320, 20480), (20488, 24576)]
    drained = {b for start, end in runs for b in range(start, end)}
    on_host = {b for r, s in zip(records, sources, strict=True) if s.device.type == "cpu"
               for b in range(r.offset, r.offset + r.nbytes)}  # fmt: skip
    assert drained | on_host == set(range(flat.data_off, flat.size)) and not drained & on_host


def test_a_copy_into_a_slot_registered_in_pieces_never_crosses_from_one_piece_into_the_next(tmp_path: Path) -> None:
    """CUDA refuses (invalid argument) a copy into host memory that spans two registrations."""
    dir_fd = open_job_dir(str(tmp_path), "pieces")
    slot = Slot(dir_fd, "rank-00000.slot0")
    try:
        slot._registered = [0, PIN_PIECE, 2 * PIN_PIECE]  # as _pin leaves them (addresses do not matter here)
        offset, length = 3 * 4096, 2 * PIN_PIECE + 12345
        spans = slot.spans(offset, length)
        assert len(spans) == 3
        assert sum(n for _, n in spans) == length and spans[0][0] == offset
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))  # they tile the range
        for at, n in spans:  # each within one piece of the mapping (the header is in the first)
            assert (HEADER_LEN + at) // PIN_PIECE == (HEADER_LEN + at + n - 1) // PIN_PIECE
        slot._registered = [0]  # the set-up window: the first piece registered, the rest not yet
        assert slot.spans(offset, length) == spans
        slot._registered = []
        assert slot.spans(offset, length) == [(offset, length)]
    finally:
        slot._registered = []
        slot.close()
        os.close(dir_fd)


def test_the_drain_copies_planned_once_per_layout_cover_each_portion_and_stay_within_one_registered_piece(
    tmp_path: Path,
) -> None:
    """The drain's copies are cut once per layout (not at each step): for any portion of whole chunks they must
    still be exactly its bytes that drain (CPU tensors went at the boundary), each inside one registered piece,
    and no more copies than the pieces it touches (a chunk boundary inside a piece cuts nothing)."""
    gpu = torch.empty(0, device="meta")
    cpu = torch.zeros(8, dtype=torch.uint8)
    big = 3 * PIN_PIECE + 12345
    records = [_record(8192, big), _record(8192 + big, 8), _record(8192 + big + 4096, PIN_PIECE // 2)]
    size = 8192 + big + 4096 + PIN_PIECE // 2
    flat = FlatState(prefix=b"", records=records, sources=[gpu, cpu, gpu], data_off=8192, size=size)
    layout = layout_of(flat, [True] * 3, [])
    dir_fd = open_job_dir(str(tmp_path), "plan")
    slot = Slot(dir_fd, "rank-00000.slot0")
    try:
        slot._registered = [0, PIN_PIECE]  # pinned: every piece boundary cuts a copy
        chunks = layout.chunks
        whole = layout.drain_copies(slot, chunks[1][0], size)
        assert whole == [span for a, b in layout.runs for span in slot.spans(a, b - a)]
        for first, stop in ((1, 2), (1, 5), (3, 9), (6, len(chunks)), (len(chunks) - 1, len(chunks))):
            start, end = chunks[first][0], chunks[stop - 1][0] + chunks[stop - 1][1]
            copies = layout.drain_copies(slot, start, end)
            merged: list[list[int]] = []  # the copies, touching ones joined: they must be the portion's part of runs
            for at, n in copies:
                if merged and merged[-1][1] == at:
                    merged[-1][1] = at + n
                else:
                    merged.append([at, at + n])
            want = [[max(a, start), min(b, end)] for a, b in layout.runs if a < end and b > start]
            assert merged == want, (first, stop)
            for at, n in copies:
                assert (HEADER_LEN + at) // PIN_PIECE == (HEADER_LEN + at + n - 1) // PIN_PIECE
            pieces = {(HEADER_LEN + at) // PIN_PIECE for at, _ in copies}
            assert len(copies) <= len(pieces) + len(layout.runs) - 1, (first, stop, copies)
    finally:
        slot._registered = []
        slot.close()
        os.close(dir_fd)


def test_a_committed_header_whose_chunk_count_does_not_fit_its_payload_is_not_loaded(tmp_path: Path) -> None:
    """The count is checked by arithmetic now (the chunk list is no longer made at each read): one chunk more or
    one fewer than the payload has is still a header no reader trusts."""
    dir_fd = open_job_dir(str(tmp_path), "count")
    slot = Slot(dir_fd, "rank-00000.slot0")
    try:
        chunk, data_off, payload = 1 << 20, 4096, 4096 + 5 * (1 << 20) + 7  # the structure, then 6 chunks
        slot.map_sparse(payload)
        for n, loads in ((7, True), (8, False), (6, False)):
            slot.commit(step=3, seq=1, payload_len=payload, data_off=data_off, chunk=chunk, crcs=[0] * n,
                        world_size=1, rank=0)  # fmt: skip
            header = read_header(slot.fd)
            assert (header is not None) == loads, n
            if header is not None:
                assert len(header.chunks()) == n
    finally:
        slot.close()
        os.close(dir_fd)


def test_both_slots_are_mapped_before_either_is_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registration that waits for another slot's page walk holds the driver's lock: the job's CUDA calls wait."""
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(Slot, "fill", lambda self, **_: events.append(("fill", self.name)))
    monkeypatch.setattr(Slot, "pin", lambda self: events.append(("pin", self.name)))
    dir_fd = open_job_dir(str(tmp_path), "order")
    try:
        prepared = prepare.Preparation(dir_fd, 0, 1 << 20, cuda=0, staging=False, replace=set()).join()
    finally:
        os.close(dir_fd)
    assert prepared.error is None, prepared.error
    kinds = [kind for kind, _ in events]
    assert kinds == ["fill", "fill", "pin", "pin"], events
    names = {"rank-00000.slot0", "rank-00000.slot1"}
    assert {name for _, name in events[:2]} == {name for _, name in events[2:]} == names
    for slot in prepared.slots.values():
        slot.close()


def test_a_copy_the_runtime_refuses_goes_through_torch_and_the_runtime_is_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    copier = cudacopy.StreamCopier(SimpleNamespace(cuda_stream=0))
    copier._memcpy = lambda *args: calls.append(1) or 1  # cudaErrorInvalidValue
    monkey_runtime = SimpleNamespace(cudaGetLastError=lambda: 0)
    cudacopy._RUNTIME[:] = [monkey_runtime]
    done: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwatch.snapshots"):
            copier.copy(1, 2, 3, lambda: done.append(1))
            copier.copy(1, 2, 3, lambda: done.append(2))
    finally:
        cudacopy._RUNTIME.clear()
    assert calls == [1] and done == [1, 2]
    assert caplog.text.count("cudaMemcpyAsync failed (CUDA error 1)") == 1


def test_without_a_shared_cuda_runtime_in_the_process_copies_go_through_torch() -> None:
    cudacopy._RUNTIME.clear()
    try:
        if cudacopy.runtime() is not None:
            pytest.skip("this process has a CUDA runtime loaded")
        done: list[int] = []
        cudacopy.StreamCopier(SimpleNamespace(cuda_stream=0)).copy(1, 2, 3, lambda: done.append(1))
        assert done == [1]
    finally:
        cudacopy._RUNTIME.clear()


def test_before_any_plain_step_a_drain_portion_is_sized_on_the_latest_step_not_one_chunk(tmp_path: Path) -> None:
    """A snapshot started with the slots' first step leaves no plain step to size the drain on; sized on the latest
    step instead, a portion is a share of a real step, so the drain ends inside K steps and not on the loop."""
    from gpuwatch.snapshots import HostSnapshot
    from gpuwatch.snapshots.staged import DRAIN_SHARE, Stager

    snap = HostSnapshot(dict, every=8, root=str(tmp_path), job_id="drain-budget")
    try:
        stager = Stager.__new__(Stager)  # the sizing alone: no staging buffer, stream or thread
        stager.rate = 20 << 30
        snap._stager = stager
        loop = snap._pacing.time
        for t in (0.0, 0.1, 0.2):
            loop.tick(t)
            loop.record(0.1, in_flight=True)  # every step so far with a snapshot in flight
        assert loop.median_plain_step() is None
        assert snap._drain_budget() == int(DRAIN_SHARE * 0.1 * (20 << 30))
        loop.record(0.05, in_flight=False)  # once a plain step is seen, the drain is sized on it
        assert snap._drain_budget() == int(DRAIN_SHARE * 0.05 * (20 << 30))
    finally:
        snap._stager = None
        snap.close(remove=True)


def test_the_drain_starts_the_step_after_the_boundary_not_behind_its_device_to_device_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A portion queued at the boundary waits behind that step's device-to-device copy and ends after the loop's
    own copy at the end of the next step: the first portion goes one step later, then one a step."""
    import threading

    from gpuwatch.snapshots import HostSnapshot
    from gpuwatch.snapshots.staged import StagedJob

    snap = HostSnapshot(dict, every=4, root=str(tmp_path), job_id="drain-start")
    queued: list[tuple[int, int | None]] = []  # (the snapshot's step, the step whose call queued a portion)

    def start(step: int) -> None:
        job = StagedJob.__new__(StagedJob)  # the drain's timing alone: no staging buffer, stream or slot
        job.step, job.window, job.released, job.intervals, job.host_s = step, False, True, [], 0.0
        job.committed = threading.Event()
        job.advance = lambda budget: queued.append((step, snap._step_now))  # type: ignore[method-assign]
        snap._job, snap._pacing.last_snap_step = job, step

    monkeypatch.setattr(snap, "_start", start)
    monkeypatch.setattr(snap, "_drain_budget", lambda: 1 << 20)
    snap._setup.prepared = SimpleNamespace(staging=None, pinned=True)  # type: ignore[assignment]
    try:
        for step in range(1, 7):
            snap.step(step)
        assert queued == [(4, 5), (4, 6)]
    finally:
        snap._job, snap._setup.prepared = None, None
        snap.close(remove=True)


def test_a_snapshot_due_while_the_staged_drain_runs_starts_at_its_commit_and_the_loop_never_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every 2 with a drain of five steps: waiting for each commit held the step (3x a plain one at every 4 and
    16 GiB on an H100). The drain goes on a portion a step, the next snapshot starts at the step its commit is
    seen, one warning says snapshots then land once a drain, and stats() counts them."""
    import threading

    from gpuwatch.snapshots import HostSnapshot
    from gpuwatch.snapshots.staged import StagedJob

    snap = HostSnapshot(dict, every=2, root=str(tmp_path), job_id="defer")
    started: list[int] = []

    def start(step: int) -> None:
        job = StagedJob.__new__(StagedJob)  # the drain's pacing alone: a portion a step, committed after five
        job.step, job.window, job.released, job.intervals, job.host_s = step, False, True, [], 0.0
        job.error, job.copy_s, job.worker_s = None, 0.0, 0.0
        job.committed = threading.Event()
        portions: list[int] = []

        def advance(budget: int) -> None:
            portions.append(budget)
            if len(portions) == 5:
                job.committed.set()

        def wait_committed(timeout: float | None = None) -> None:
            assert job.committed.is_set(), f"the loop waited for the drain of step {step}"

        job.advance = advance  # type: ignore[method-assign]
        job.wait_committed = wait_committed  # type: ignore[method-assign]
        snap._job = job
        snap._pacing.started(step)
        started.append(step)

    monkeypatch.setattr(snap, "_start", start)
    monkeypatch.setattr(snap, "_drain_budget", lambda: 1 << 20)
    snap._setup.prepared = SimpleNamespace(staging=None, pinned=True, budget=None)  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwatch.snapshots"):
            for step in range(1, 31):
                snap.step(step)
        stats = snap.stats()
    finally:
        snap._job, snap._setup.prepared = None, None
        snap.close(remove=True)
    assert started == [2, 8, 14, 20, 26]  # due at 4, 10, ...: each starts at the step its predecessor's commit is seen
    assert stats["deferred_snapshots"] == 5 and stats["waited_snapshots"] == 0, stats  # the fifth: due at 28
    lines = [r.getMessage() for r in caplog.records if "drain's floor" in r.getMessage()]
    assert len(lines) == 1 and "due at step 4 starts when the previous one's drain commits" in lines[0], lines
