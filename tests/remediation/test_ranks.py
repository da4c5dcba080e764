"""ranks.py: a real child process's /proc/PID/environ mapped to its GPU by UUID, trust, liveness."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.model import GpuSample, GpuStatic, GpuStatus, TrainerInfo
from gpuwatch.node.ranks import map_ranks, resolve_gpu

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")

UUIDS = [f"GPU-{i}a5e0c2f-1111-2222-3333-44445555666{i}" for i in range(4)]


def gpus(pids: dict[int, tuple[int, ...]] | None = None) -> list[GpuStatus]:
    """Four GPUs; `pids` is NVML's process list per GPU index."""
    return [
        GpuStatus(
            static=GpuStatic(index=i, uuid=uuid),
            sample=GpuSample(t=0.0, index=i, uuid=uuid, pids=(pids or {}).get(i, ())),
        )
        for i, uuid in enumerate(UUIDS)
    ]


Spawn = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    children: list[subprocess.Popen[str]] = []

    def start(**env: str) -> subprocess.Popen[str]:
        base = {k: v for k, v in os.environ.items() if k not in {"CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK"}}
        code = "import time; print('ready', flush=True); time.sleep(30)"
        child = subprocess.Popen([sys.executable, "-c", code], env={**base, **env}, stdout=subprocess.PIPE, text=True)
        children.append(child)
        # A rank is mapped once it reports or opens CUDA, long after exec: wait until the child runs.
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        return child

    yield start
    for child in children:
        with child:  # closes its pipe and waits
            child.kill()


TORCHRUN_ENV = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "j1"}


@pytest.mark.parametrize(
    ("visible", "expected_gpu"),
    [
        (f"{UUIDS[2]},{UUIDS[3]}", 3),  # UUIDs: the entry at LOCAL_RANK
        ("2,0", 0),  # indices: LOCAL_RANK 1 → visible[1] = NVML index 0
        (UUIDS[2][:12], 2),  # one entry, an abbreviated UUID: the worker's only GPU
        (None, 1),  # unset: every GPU in NVML's order, LOCAL_RANK is the index
    ],
)
def test_rank_and_gpu_from_a_real_child_environ(spawn: Spawn, visible: str | None, expected_gpu: int) -> None:
    env = dict(TORCHRUN_ENV, **({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}))
    child = spawn(**env)
    proc = ProcFs()

    # The trainer wrote a report without a GPU uuid (no torch CUDA): the environ resolves it.
    report = TrainerInfo(pid=child.pid, step=12, updated_t=1.0)
    (rank,) = map_ranks(gpus(), [report], proc, use_pids=False)

    assert rank.pid == child.pid
    assert (rank.info.rank, rank.info.local_rank, rank.info.world_size, rank.info.local_world_size) == (5, 1, 8, 4)
    assert rank.info.job_id == "j1"
    assert rank.info.step == 12
    assert (rank.gpu, rank.info.gpu_uuid) == (expected_gpu, UUIDS[expected_gpu])
    assert rank.sources == ("report", "environ")
    assert rank.uid == os.getuid()
    assert rank.start_time is not None and proc.alive(child.pid, rank.start_time)


def test_nvml_pid_with_torchrun_env_is_a_rank_without_a_report(spawn: Spawn) -> None:
    trainer = spawn(**TORCHRUN_ENV, CUDA_VISIBLE_DEVICES=f"{UUIDS[0]},{UUIDS[1]}", GPUWATCH_JOB_ID="ignored")
    stranger = spawn()  # a CUDA process that is no trainer: never a rank, never signalled

    ranks = map_ranks(
        gpus({1: (trainer.pid, stranger.pid), 0: (trainer.pid,)}),  # a stray context on GPU 0 too
        [],
        ProcFs(),
        use_pids=True,
    )

    assert [(r.pid, r.gpu, r.info.rank, r.job, r.sources) for r in ranks] == [
        (trainer.pid, 1, 5, "j1", ("environ", "nvml"))
    ]


def test_sim_pids_are_never_read() -> None:
    own = os.getpid()  # a real process: with use_pids=False it is not even looked at

    assert map_ranks(gpus({0: (own,)}), [], ProcFs(), use_pids=False) == []


def test_report_uuid_wins_and_job_comes_from_the_report(spawn: Spawn) -> None:
    child = spawn(**TORCHRUN_ENV, CUDA_VISIBLE_DEVICES="0,1")
    report = TrainerInfo(pid=child.pid, rank=5, job_id="from-report", gpu_uuid=UUIDS[3], updated_t=1.0)

    (rank,) = map_ranks(gpus(), [report], ProcFs(), use_pids=False)

    assert (rank.gpu, rank.job) == (3, "from-report")


def test_alive_sees_exit_zombies_and_recycled_pids(spawn: Spawn) -> None:
    child = spawn()
    proc = ProcFs()
    start = proc.start_time(child.pid)

    assert proc.alive(child.pid, start)
    assert not proc.alive(child.pid, (start or 0) + 1)  # same PID, another process
    child.kill()
    child.wait(timeout=5)  # reaped: gone
    assert not proc.alive(child.pid, start)


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = ProcFs()
    start = proc.start_time(child.pid)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not finish"
            time.sleep(0.01)  # finished but not reaped: a zombie, still in /proc
        assert not proc.alive(child.pid, start)
    finally:
        child.wait()


def test_an_empty_environ_read_is_read_again(tmp_path: Path) -> None:
    # The kernel shows an empty environ while exec builds the new stack; PID and start time stay.
    pid_dir = tmp_path / "42"
    pid_dir.mkdir()
    (pid_dir / "stat").write_text("42 (python) S " + " ".join(["0"] * 18) + " 777 0\n")
    (pid_dir / "environ").write_bytes(b"")
    proc = ProcFs(tmp_path)

    assert proc.environ(42) == {}
    (pid_dir / "environ").write_bytes(b"PATH=/bin\0RANK=3\0LOCAL_RANK=1\0")
    assert proc.environ(42) == {"RANK": "3", "LOCAL_RANK": "1"}
    (pid_dir / "environ").write_bytes(b"RANK=9\0")  # a full read is the environment at exec: cached
    assert proc.environ(42) == {"RANK": "3", "LOCAL_RANK": "1"}


def test_an_unreadable_environ_is_not_read_again_every_tick(tmp_path: Path) -> None:
    pid_dir = tmp_path / "43"
    pid_dir.mkdir()
    (pid_dir / "stat").write_text("43 (python) S " + " ".join(["0"] * 18) + " 777 0\n")
    proc = ProcFs(tmp_path)  # no environ file: as for a process the daemon may not read

    assert proc.environ(43) is None
    (pid_dir / "environ").write_bytes(b"RANK=3\0")
    assert proc.environ(43) is None


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, None),  # LOCAL_RANK beyond the list
        ({"CUDA_VISIBLE_DEVICES": ""}, None),  # no GPU at all
        ({"CUDA_VISIBLE_DEVICES": "GPU-"}, None),  # a prefix of every UUID: ambiguous
        ({"CUDA_VISIBLE_DEVICES": "MIG-1234"}, None),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": f"{UUIDS[0]}, {UUIDS[2]}"}, 2),
    ],
)
def test_resolve_gpu_edge_cases(env: dict[str, str], expected: int | None) -> None:
    found = resolve_gpu(env, gpus())

    assert (found.index if found else None) == expected


class CountingProcFs(ProcFs):
    """The real /proc, counting how often each rank's identity (stat, status and exe) is read."""

    def __init__(self) -> None:
        super().__init__()
        self.identities: dict[int, int] = {}

    def _read_identity(self, pid: int, fields: list[str]):  # type: ignore[no-untyped-def]
        self.identities[pid] = self.identities.get(pid, 0) + 1
        return super()._read_identity(pid, fields)


def test_a_round_reads_each_ranks_identity_once(spawn: Spawn) -> None:
    """With many ranks on a node, a round's cost was mostly /proc: the uid and the identity each read it all."""
    children = [spawn(**{**TORCHRUN_ENV, "CUDA_VISIBLE_DEVICES": UUIDS[1]}) for _ in range(3)]
    proc = CountingProcFs()
    ranks = map_ranks(gpus(), [TrainerInfo(pid=c.pid) for c in children], proc, use_pids=False)
    assert sorted(r.pid for r in ranks) == sorted(c.pid for c in children)
    assert all(r.uid == os.getuid() and r.start_time is not None for r in ranks)
    assert proc.identities == {c.pid: 1 for c in children}
    map_ranks(gpus(), [TrainerInfo(pid=c.pid) for c in children], proc, use_pids=False)
    assert proc.identities == {c.pid: 1 for c in children}  # the next round: known ranks, only their stat
