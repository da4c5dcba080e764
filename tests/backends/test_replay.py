"""The replay backend and iter_ticks: file order, the trace's own timestamps, events and errors."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from gpuwatch.backends.base import Backend
from gpuwatch.backends.replay import ReplayBackend, Tick, iter_ticks
from gpuwatch.backends.trace import Trace, TraceWriter
from gpuwatch.config import Config
from gpuwatch.errors import BackendError, GpuReadError, TraceError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic
from tests.helpers import HEALTHY_TRACE

SHARED_TRACE = HEALTHY_TRACE  # the real H200 trace of shared/traces, committed under tests/data
STATICS = (GpuStatic(index=0, uuid="GPU-a", name="NVIDIA H200"), GpuStatic(index=1, uuid="GPU-b", name="NVIDIA H200"))


def sample(t: float, index: int, power: float = 100.0) -> GpuSample:
    return GpuSample(t=t, index=index, uuid=STATICS[index].uuid, power_w=power)


XID = GpuEvent(t=101.5, index=1, uuid="GPU-b", kind="xid", xid=79)
LOST = GpuError(t=102.0, index=0, uuid="GPU-a", kind="gpu_lost")
LATE = GpuEvent(t=150.0, index=0, uuid="GPU-a", kind="ecc_dbe")
READINGS = (
    sample(100.0, 0),
    sample(100.0, 1),
    sample(101.0, 0, 200.0),
    sample(101.0, 1, 201.0),
    XID,
    LOST,
    sample(102.0, 1, 202.0),
    LATE,
)


def open_replay(tmp_path: Path, readings: tuple = READINGS) -> ReplayBackend:
    path = tmp_path / "trace.jsonl"
    with TraceWriter(path, STATICS, note="test") as writer:
        for reading in readings:
            writer.write(reading)
    backend = ReplayBackend(Config(backend="replay", replay_file=str(path)))
    assert backend.open() == STATICS
    return backend


def test_is_a_backend(tmp_path: Path) -> None:
    backend = open_replay(tmp_path)
    assert isinstance(backend, Backend)
    assert backend.name == "replay"


def test_plays_back_in_file_order_on_its_own_timestamps(tmp_path: Path) -> None:
    backend = open_replay(tmp_path)
    assert backend.sample(0, now=9999.0) == sample(100.0, 0)
    assert backend.sample(1, now=9999.0) == sample(100.0, 1)
    assert backend.wait_events(0) == []
    assert backend.sample(0, now=1.0, slow=True) == sample(101.0, 0, 200.0)
    assert backend.sample(1, now=1.0) == sample(101.0, 1, 201.0)
    assert backend.wait_events(0) == []  # the XID at 101.5 lies after the last sample handed out
    with pytest.raises(GpuReadError) as info:
        backend.sample(0, now=1.0)
    assert info.value.kind == "gpu_lost"
    assert not backend.exhausted
    assert backend.sample(1, now=1.0) == sample(102.0, 1, 202.0)
    # Every sample has been handed out, so the event after the last one comes too.
    assert backend.wait_events(0) == [XID, LATE]
    assert backend.exhausted
    assert backend.wait_events(0) == []
    with pytest.raises(BackendError, match="no more readings for GPU 0"):
        backend.sample(0, now=1.0)


def test_events_come_once_the_samples_pass_them(tmp_path: Path) -> None:
    backend = open_replay(tmp_path)
    for index in (0, 1, 0, 1):
        backend.sample(index, 0.0)
    with pytest.raises(GpuReadError):
        backend.sample(0, 0.0)  # the error line at 102.0 moves the replay past the XID at 101.5
    assert backend.wait_events(0) == [XID]


def test_wait_events_does_not_block(tmp_path: Path) -> None:
    backend = open_replay(tmp_path)
    started = time.monotonic()
    assert backend.wait_events(30) == []
    assert time.monotonic() - started < 0.5
    backend.close()
    backend.close()


def test_no_file_and_bad_file(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="no trace file"):
        ReplayBackend(Config(backend="replay")).open()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "gpuwatch-trace", "version": 1, "static": []}\n{"t": 1}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: reading has no 'index' field"):
        ReplayBackend(Config(backend="replay", replay_file=str(bad))).open()


def test_replays_the_shared_trace() -> None:
    backend = ReplayBackend(Config(backend="replay", replay_file=str(SHARED_TRACE)))
    (static,) = backend.open()
    samples = []
    while not backend.exhausted:
        samples.append(backend.sample(static.index, time.time()))
    assert len(samples) == 240
    assert [s.t for s in samples] == sorted(s.t for s in samples)
    assert samples[-1].t - samples[0].t == pytest.approx(239.038, abs=0.01)


def test_iter_ticks_groups_rounds_and_joins_events() -> None:
    trace = Trace(statics=STATICS, note="", readings=READINGS)
    ticks = list(iter_ticks(trace))
    assert ticks == [
        Tick(100.0, (sample(100.0, 0), sample(100.0, 1))),
        Tick(101.5, (sample(101.0, 0, 200.0), sample(101.0, 1, 201.0), XID)),
        Tick(150.0, (LOST, sample(102.0, 1, 202.0), LATE)),
    ]


def test_iter_ticks_sorts_and_handles_staggered_times() -> None:
    readings = (sample(10.002, 1), sample(10.0, 0), sample(11.001, 0), sample(11.003, 1), sample(12.0, 0))
    ticks = list(iter_ticks(Trace(statics=STATICS, note="", readings=readings)))
    assert [[(r.index, r.t) for r in tick.readings] for tick in ticks] == [
        [(0, 10.0), (1, 10.002)],
        [(0, 11.001), (1, 11.003)],
        [(0, 12.0)],
    ]
    assert [tick.t for tick in ticks] == [10.002, 11.003, 12.0]
    assert list(iter_ticks(Trace(statics=STATICS, note="", readings=()))) == []


def test_iter_ticks_is_fast_for_an_hour_of_eight_gpus() -> None:
    statics = tuple(GpuStatic(index=i, uuid=f"GPU-{i}") for i in range(8))
    base = GpuSample(t=0.0, index=0, uuid="GPU-0", power_w=600.0)
    readings = tuple(
        dataclasses.replace(base, t=1000.0 + s + i * 1e-4, index=i, uuid=f"GPU-{i}")
        for s in range(3600)
        for i in range(8)
    )
    started = time.thread_time()  # this thread's CPU time: the parallel lane's other workers do not count
    ticks = list(iter_ticks(Trace(statics=statics, note="", readings=readings)))
    assert time.thread_time() - started < 0.5  # linear: a quadratic grouping of 28,800 readings takes minutes
    assert len(ticks) == 3600 and all(len(t.readings) == 8 for t in ticks)
