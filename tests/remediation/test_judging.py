"""TrainerJudge: a job is hung only on positive evidence about a rank's process, never on its silence.

Seen on two H200s (NCCL): the SIGSTOPped rank's report went stale, NVML kept listing its pid and
the NCCL peer spun its GPU at 100 %: the stopped process is the evidence. Seen as a hostile local
user: ranks whose reports could not be written (a full runtime dir) were judged hung and stopped;
silence alone must never stop a job.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.config import TrainerConfig
from gpuwatch.model import GpuSample, GpuStatic, GpuStatus, Snapshot, TrainerInfo
from gpuwatch.node.ranks import JobKey, Rank
from gpuwatch.remediation.judging import Hang, TrainerJudge

T0 = 1_800_000_000.0
CFG = TrainerConfig(hang_after_s=10.0, stale_after_s=5.0)
UUIDS = ("GPU-0000", "GPU-1111")


def snapshot(t: float, util: int = 100) -> Snapshot:
    """Two GPUs of a live backend, busy by default (NCCL spins while it waits)."""
    gpus = tuple(
        GpuStatus(static=GpuStatic(index=i, uuid=u), sample=GpuSample(t=t, index=i, uuid=u, util_gpu_pct=util))
        for i, u in enumerate(UUIDS)
    )
    return Snapshot(t=t, backend="nvml", gpus=gpus)


def rank(pid: int, index: int, updated_t: float | None, step: int | None, uid: int | None = None) -> Rank:
    uid = os.getuid() if uid is None else uid
    info = TrainerInfo(
        pid=pid, rank=index, job_id="job", gpu_uuid=UUIDS[index], step=step, updated_t=updated_t, uid=uid
    )
    return Rank(info, index, uid, None, ("report", "nvml") if updated_t is not None else ("environ", "nvml"))


@pytest.fixture
def spinning() -> Iterator[subprocess.Popen[bytes]]:
    """A process that keeps using CPU (a rank busy in its collective, or an evaluation pass)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def stopped() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGSTOP)
    while ProcFs().run_state(proc.pid) != "T":  # the state changes once the child takes the signal
        time.sleep(0.01)
    yield proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def run(
    judge: TrainerJudge, ranks_at: Callable[[float], list[Rank]], seconds: int = 16, util: int = 100
) -> tuple[dict[JobKey, Hang], int]:
    """Judge once a second of fake time until a job is hung (or `seconds` pass); the hung jobs and when."""
    hung: dict[JobKey, Hang] = {}
    second = 0
    for second in range(1, seconds):
        now = T0 + second
        time.sleep(0.03)  # real time too: a busy process's CPU time must be able to grow between judgements
        hung = judge.judge(snapshot(now, util), ranks_at(now)).hung
        if hung:
            break
    return hung, second


def test_a_stopped_rank_that_nvml_still_lists_makes_its_job_hung(
    spinning: subprocess.Popen[bytes], stopped: subprocess.Popen[bytes]
) -> None:
    judge = TrainerJudge(CFG, ProcFs())
    judge.judge(snapshot(T0), [rank(spinning.pid, 0, T0, 40), rank(stopped.pid, 1, T0, 40)])

    # rank 0's link still reports (it waits in the collective); rank 1 is frozen: NVML alone lists it.
    hung, second = run(judge, lambda now: [rank(spinning.pid, 0, now, 40), rank(stopped.pid, 1, None, None)])

    assert list(hung) == [(os.getuid(), "job")]
    (hang,) = hung.values()
    assert "rank 1 of job job is stopped (SIGSTOP)" in hang.finding.reason
    assert {m.pid for m in hang.members} == {spinning.pid, stopped.pid}
    assert [r.pid for r in hang.frozen] == [stopped.pid]
    assert CFG.hang_stopped_after_s <= second <= 5, "a stopped rank is found in seconds, not after hang_after_s"


def test_silent_reports_of_running_processes_are_no_hang(spinning: subprocess.Popen[bytes]) -> None:
    """Both ranks' reports stop arriving (they cannot be sent), the steps stand still: no evidence, no hang."""
    other = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        judge = TrainerJudge(CFG, ProcFs())
        judge.judge(snapshot(T0), [rank(spinning.pid, 0, T0, 40), rank(other.pid, 1, T0, 40)])

        hung, _ = run(judge, lambda now: [rank(spinning.pid, 0, None, None), rank(other.pid, 1, None, None)], 40)

        assert hung == {}
    finally:
        other.kill()
        other.wait()


class _NoCpu(ProcFs):
    """A /proc whose processes run (state S) but never use CPU time: a rank wedged in a driver call."""

    def main_thread_cpu_ns(self, pid: int) -> int | None:
        return 1234

    def run_state(self, pid: int) -> str | None:
        return "S"


def test_a_rank_that_uses_no_cpu_and_takes_no_step_is_frozen_within_its_limit_by_default() -> None:
    cfg = TrainerConfig()
    judge = TrainerJudge(cfg, _NoCpu())
    pid_a, pid_b = os.getpid(), os.getppid()
    judge.judge(snapshot(T0), [rank(pid_a, 0, T0, 40), rank(pid_b, 1, T0, 40)])

    hung, second = run(judge, lambda now: [rank(pid_a, 0, now, 40), rank(pid_b, 1, now, 40)], util=0)

    (hang,) = hung.values()
    assert "used no CPU time on its main thread and finished no step for" in hang.finding.reason
    assert cfg.hang_frozen_after_s <= second <= cfg.hang_frozen_after_s + 2, "max(10 s, 20 × p99 step)"


def test_two_users_with_one_job_id_are_two_jobs(
    stopped: subprocess.Popen[bytes], spinning: subprocess.Popen[bytes]
) -> None:
    """mallory's frozen process claims the victim's job id: only mallory's job is hung, the victim's is apart."""
    mallory, victim = 54_321, 12_345
    judge = TrainerJudge(CFG, ProcFs())
    judge.judge(snapshot(T0), [rank(stopped.pid, 0, T0, 40, uid=mallory), rank(spinning.pid, 1, T0, 40, uid=victim)])

    hung, _ = run(
        judge, lambda now: [rank(stopped.pid, 0, None, None, uid=mallory), rank(spinning.pid, 1, now, 40, uid=victim)]
    )

    assert list(hung) == [(mallory, "job")]
    (hang,) = hung.values()
    assert {m.pid for m in hang.members} == {stopped.pid}


def paused_rank(pid: int, index: int, now: float, until: float | None) -> Rank:
    """A rank at step 40 (finished at T0) whose loop declared a pause lasting until `until`."""
    base = rank(pid, index, now, 40)
    info = dataclasses.replace(base.info, step_t=T0, pause="checkpoint" if until else None, pause_until=until)
    return dataclasses.replace(base, info=info)


def test_a_declared_pause_is_no_hang_while_it_lasts_and_the_limits_run_from_its_end() -> None:
    """A 30 s blocking checkpoint with the main thread idle on the disk: not frozen; idle after it: frozen 10 s on."""
    cfg = TrainerConfig()
    judge = TrainerJudge(cfg, _NoCpu())
    pid = os.getpid()
    end = T0 + 30

    hung, second = run(judge, lambda now: [paused_rank(pid, 0, now, end if now < end else end)], 50, util=0)

    (hang,) = hung.values()
    assert second == 30 + cfg.hang_frozen_after_s, "frozen only hang_frozen_after_s after the pause ended"


def test_a_pause_declared_for_ever_hides_a_frozen_rank_at_most_max_pause_s() -> None:
    """`pause(up_to_s=1e9)` with the main thread frozen: hung hang_frozen_after_s after max_pause_s, not never."""
    cfg = TrainerConfig(max_pause_s=20.0)
    judge = TrainerJudge(cfg, _NoCpu())
    pid = os.getpid()

    hung, second = run(judge, lambda now: [paused_rank(pid, 0, now, T0 + 1e9)], 60, util=0)

    assert hung, "a pause of 1e9 s hid a frozen rank"
    assert second == pytest.approx(cfg.max_pause_s + cfg.hang_frozen_after_s, abs=1)


def test_a_stopped_rank_is_found_even_inside_a_declared_pause(stopped: subprocess.Popen[bytes]) -> None:
    judge = TrainerJudge(TrainerConfig(), ProcFs())

    hung, second = run(judge, lambda now: [paused_rank(stopped.pid, 0, now, T0 + 600)], 10)

    (hang,) = hung.values()
    assert "is stopped (SIGSTOP)" in hang.finding.reason
    assert second <= 3


@pytest.mark.slow
def test_a_busy_gpu_is_no_frozen_rank_and_a_busy_cpu_waits_for_the_long_limit(
    spinning: subprocess.Popen[bytes],
) -> None:
    """A long kernel (main thread still, GPU at 100 %) and a compile (CPU busy, GPU idle): only hang_after_s applies."""
    cfg = TrainerConfig()
    still, busy = TrainerJudge(cfg, _NoCpu()), TrainerJudge(cfg, ProcFs())

    long_kernel, _ = run(still, lambda now: [rank(os.getpid(), 0, now, 40)], 50, util=100)
    compiling, second = run(busy, lambda now: [rank(spinning.pid, 0, now, 40)], 70, util=0)

    assert long_kernel == {}
    assert second >= cfg.hang_after_s and "its GPUs sit idle" in next(iter(compiling.values())).finding.reason


def test_a_stopped_ranks_verdict_is_due_when_its_limit_ends_not_at_the_next_poll(
    spinning: subprocess.Popen[bytes], stopped: subprocess.Popen[bytes]
) -> None:
    """The remediation thread judges again when the first rank seen stopped reaches hang_stopped_after_s (1 s),
    not up to a poll (0.5 s) later; the limit itself stays: a debugger's short stop is no hang."""
    limit = CFG.hang_stopped_after_s
    judge = TrainerJudge(CFG, ProcFs())
    ranks = [rank(spinning.pid, 0, T0, 40), rank(stopped.pid, 1, T0, 40)]
    assert not judge.hangs(T0, ranks, snapshot(T0))  # seen stopped from now, its step still
    assert judge.stopped_verdict_in(T0 + 0.25) == pytest.approx(limit - 0.25)
    assert not judge.hangs(T0 + limit - 0.1, ranks, snapshot(T0 + limit - 0.1))  # just short of it: not yet
    assert judge.hangs(T0 + limit + 0.01, ranks, snapshot(T0 + limit + 0.01))  # its limit ended
    assert judge.stopped_verdict_in(T0 + limit + 0.01) is None  # due already: the next poll as usual
    running = TrainerJudge(CFG, ProcFs())
    running.hangs(T0, ranks[:1], snapshot(T0))
    assert running.stopped_verdict_in(T0) is None  # no rank stopped: nothing falls due


def test_a_rank_stopped_right_after_a_step_is_seen_stopped_at_the_first_poll_that_sees_that_step(
    spinning: subprocess.Popen[bytes], stopped: subprocess.Popen[bytes]
) -> None:
    """A rank that made a step between two polls and was stopped after it (SIGSTOP, a debugger) counts as stopped
    from the poll that sees its new step, not from the poll after that: its limit is not lengthened by a poll."""
    limit = CFG.hang_stopped_after_s
    judge = TrainerJudge(CFG, ProcFs())
    assert not judge.hangs(T0, [rank(spinning.pid, 0, T0, 40), rank(stopped.pid, 1, T0, 40)], snapshot(T0))
    judge_after = [rank(spinning.pid, 0, T0 + 0.5, 41), rank(stopped.pid, 1, T0 + 0.4, 41)]  # rank 1 stepped
    assert not judge.hangs(T0 + 0.5, judge_after, snapshot(T0 + 0.5))
    assert judge.stopped_verdict_in(T0 + 0.5) == pytest.approx(limit)
    assert judge.hangs(T0 + 0.5 + limit + 0.01, judge_after, snapshot(T0 + 0.5 + limit + 0.01))
