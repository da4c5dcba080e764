"""TrainerJudge: a frozen rank that NVML still lists keeps its last report, so the job's hang is found.

Seen on two H200s (NCCL): the SIGSTOPped rank's report went stale, NVML kept listing its pid, the
rank was then known only from its environment (no step, no report time), and its silence, the
sign of the hang, was lost while the NCCL peer spun its GPU at 100 %.
"""

from __future__ import annotations

import os

from gpuwatch.config import TrainerConfig
from gpuwatch.model import GpuSample, GpuStatic, GpuStatus, Snapshot, TrainerInfo
from gpuwatch.procfs import ProcFs
from gpuwatch.ranks import Rank
from gpuwatch.remediation.judging import TrainerJudge

T0 = 1_800_000_000.0
CFG = TrainerConfig(hang_after_s=10.0, stale_after_s=5.0)
UUIDS = ("GPU-0000", "GPU-1111")


def snapshot(t: float) -> Snapshot:
    """Two busy GPUs of a live backend (NCCL spins while it waits)."""
    gpus = tuple(
        GpuStatus(static=GpuStatic(index=i, uuid=u), sample=GpuSample(t=t, index=i, uuid=u, util_gpu_pct=100))
        for i, u in enumerate(UUIDS)
    )
    return Snapshot(t=t, backend="nvml", gpus=gpus)


def rank(pid: int, index: int, updated_t: float | None, step: int | None) -> Rank:
    info = TrainerInfo(pid=pid, rank=index, job_id="job", gpu_uuid=UUIDS[index], step=step, updated_t=updated_t)
    return Rank(info, index, os.getuid(), None, ("report", "nvml") if updated_t is not None else ("environ", "nvml"))


def test_a_rank_listed_by_nvml_without_a_fresh_report_is_a_silent_member_of_its_job() -> None:
    judge = TrainerJudge(CFG, ProcFs())
    pid_a, pid_b = os.getpid(), os.getppid()  # live processes: members stay while they run
    judge.judge(snapshot(T0), [rank(pid_a, 0, T0, 40), rank(pid_b, 1, T0, 40)])
    hung = {}
    for second in range(1, 16):
        now = T0 + second
        # rank 0's link still reports (it waits in the collective); rank 1 is frozen: NVML alone lists it.
        hung = judge.judge(snapshot(now), [rank(pid_a, 0, now, 40), rank(pid_b, 1, None, None)]).hung
        if hung:
            break
    assert list(hung) == ["job"], "the frozen rank's silence must make the job hung"
    finding, members = hung["job"]
    assert "rank 1 of job job stopped reporting" in finding.reason
    assert {m.pid for m in members} == {pid_a, pid_b}
    assert second >= 10, "not before hang_after_s"
