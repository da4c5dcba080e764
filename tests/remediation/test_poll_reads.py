"""What a hang poll reads of /proc: a known rank's stat (its start time) and step page, never its identity again.

A node with hundreds of ranks polls them twice a second; reading each one's status and environ every
time was most of that poll's cost. A recycled pid (another start time) is still read in full.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.model import TrainerInfo
from gpuwatch.node.ranks import map_ranks
from gpuwatch.remediation.service import HANG_POLL_S
from tests.helpers import start_sim_node, wait_for
from tests.reporting import FakeRank

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

IDENTITY_FILES = {"status", "environ"}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, str]]]:
    """Every (pid, file) any ProcFs reads from here on."""
    seen: list[tuple[int, str]] = []
    original = ProcFs._read

    def counting(self: ProcFs, pid: int, name: str, *args: int) -> bytes:
        seen.append((pid, name))
        return original(self, pid, name, *args)

    monkeypatch.setattr(ProcFs, "_read", counting)
    yield seen


@pytest.mark.slow
def test_a_hang_poll_reads_no_identity_file_of_a_rank_it_knows(tmp_path: Path, reads: list[tuple[int, str]]) -> None:
    sim = start_sim_node(tmp_path, gpus=2)
    ranks = [FakeRank() for _ in range(3)]
    try:
        for i, rank in enumerate(ranks):
            assert rank.report(sim.daemon.config.runtime_dir, t=sim.clock.t, job_id="big", rank=i, step=1)
        pids = {rank.pid for rank in ranks}
        sim.daemon.monitor.tick()  # a publish: remediation knows the ranks and polls them from now on
        wait_for(lambda: pids <= {rank.pid for rank in sim.daemon.remediation.ranks()[0]})
        time.sleep(2 * HANG_POLL_S)  # the first poll's reads are behind us
        reads.clear()
        time.sleep(4 * HANG_POLL_S)  # no publish now: only hang polls read
        polled = [(pid, name) for pid, name in list(reads) if pid in pids]

        assert {pid for pid, name in polled if name == "stat"} == pids, "no hang poll read the ranks' start times"
        assert [entry for entry in polled if entry[1] in IDENTITY_FILES] == []
    finally:
        for rank in ranks:
            rank.end()
        sim.close()


def fake_process(root: Path, pid: int, start_time: int, uid: int) -> None:
    """/proc/PID/{stat,status,environ} as the kernel shows them (only what ProcFs reads)."""
    where = root / str(pid)
    where.mkdir(exist_ok=True)
    (where / "stat").write_text(f"{pid} (python) S " + " ".join(["0"] * 18) + f" {start_time} 0\n")
    (where / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (where / "environ").write_bytes(b"RANK=0\0LOCAL_RANK=0\0")


def test_a_known_rank_costs_one_stat_read_and_a_recycled_pid_is_read_in_full(
    tmp_path: Path, reads: list[tuple[int, str]]
) -> None:
    proc = ProcFs(tmp_path)
    fake_process(tmp_path, 42, start_time=777, uid=1000)
    report = [TrainerInfo(pid=42, job_id="j", updated_t=1.0)]

    (first,) = map_ranks((), report, proc, use_pids=False)
    reads.clear()
    (again,) = map_ranks((), report, proc, use_pids=False)

    assert reads == [(42, "stat")]
    assert (again.start_time, again.uid) == (first.start_time, first.uid) == (777, 1000)
    fake_process(tmp_path, 42, start_time=778, uid=2000)  # the rank ended; another user's process got its pid
    (recycled,) = map_ranks((), report, proc, use_pids=False)
    assert (recycled.start_time, recycled.uid) == (778, 2000)
    assert not proc.alive(42, first.start_time)
