"""Judging the trainers after each publish: each rank's timeline, each job's progress, the trainer rules.

Runs on the sampling thread (a monitor listener), so it only keeps bounded in-memory state. A
rank stays a member of its job while its process lives, even when its report goes stale; whether
it is frozen is read from /proc, never from that silence: its process is stopped (state T), or its
CPU time and its step have not moved for `stale_after_s`. A job is (uid, job id).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass

from gpuwatch.config import TrainerConfig
from gpuwatch.health import trainer_rules
from gpuwatch.model import Finding, Snapshot, TrainerInfo
from gpuwatch.procfs import ProcFs
from gpuwatch.ranks import PID_BACKENDS, JobKey, Rank

log = logging.getLogger("gpuwatch.remediation")

_STOPPED = {"T", "t"}


@dataclass(frozen=True)
class Hang:
    """A hung job: its finding, every rank it has on this node, when its last step ended, who is frozen."""

    finding: Finding
    members: tuple[Rank, ...]
    last_step_t: float
    frozen: tuple[Rank, ...]


@dataclass(frozen=True)
class Judgement:
    """One round: the rules' verdict, and each hung job."""

    verdict: trainer_rules.Verdict
    hung: dict[JobKey, Hang]


class TrainerJudge:
    """Timelines per rank, members and progress per job; `judge()` once per publish."""

    def __init__(self, cfg: TrainerConfig, proc: ProcFs) -> None:
        self.cfg = cfg
        self.proc = proc
        self._keep_s = max(cfg.fragmentation_window_s, cfg.alloc_retries_window_s, cfg.grad_var_history_s)
        self._timelines: dict[int, deque[TrainerInfo]] = {}
        self._members: dict[int, Rank] = {}  # pid → the rank as last seen, while its process lives
        self._advanced: dict[int, tuple[int | None, float]] = {}  # pid → (step, when it last changed)
        self._cpu: dict[int, tuple[int | None, float]] = {}  # pid → (CPU ns, when it last changed), while stalled
        self._active: set[tuple[str, int]] = set()

    def judge(self, snapshot: Snapshot, ranks: list[Rank]) -> Judgement:
        """Extend the timelines with the new reports, judge every rank and job, log findings as they appear."""
        self._remember(snapshot.t, ranks)
        verdict = trainer_rules.evaluate(self._timelines, snapshot.gpus, self.cfg, snapshot.t)
        hung = self._hung(snapshot)
        findings = verdict.findings + tuple(h.finding for h in hung.values())
        active = {(f.rule, f.index) for f in findings}
        for f in findings:
            if (f.rule, f.index) not in self._active:
                log.warning("trainer finding %s on GPU %d: %s", f.rule, f.index, f.reason)
        self._active = active
        return Judgement(trainer_rules.Verdict(findings, verdict.stragglers), hung)

    def members(self, job: JobKey) -> list[Rank]:
        """Every live rank of `job` seen on this node."""
        return [rank for rank in self._members.values() if rank.job_key == job]

    def _remember(self, now: float, ranks: list[Rank]) -> None:
        current = {rank.pid for rank in ranks}
        for pid, rank in list(self._members.items()):
            if pid not in current and not self.proc.alive(pid, rank.start_time):
                del self._members[pid]
                self._advanced.pop(pid, None)
                self._cpu.pop(pid, None)
        for pid in [pid for pid in self._timelines if pid not in current]:
            del self._timelines[pid]
        for rank in ranks:
            known = self._members.get(rank.pid)
            if rank.info.updated_t is None and known is not None and known.info.updated_t is not None:
                # NVML still lists it but its link went silent (a frozen process): its last report stands.
                rank = dataclasses.replace(rank, info=known.info)
            self._members[rank.pid] = rank
            info = rank.info
            step, _ = self._advanced.get(rank.pid, (None, 0.0))
            if rank.pid not in self._advanced or info.step != step:
                changed = info.step_t or info.updated_t  # the step page says when the step ended
                self._advanced[rank.pid] = (info.step, changed if changed is not None else now)
            if self._advanced[rank.pid][0] == step and info.step is not None:  # stalled: is its process?
                cpu = self.proc.cpu_ns(rank.pid)
                if rank.pid not in self._cpu or self._cpu[rank.pid][0] != cpu:
                    self._cpu[rank.pid] = (cpu, now)
            else:
                self._cpu.pop(rank.pid, None)
            if info.updated_t is None:
                continue
            timeline = self._timelines.setdefault(rank.pid, deque())
            if not timeline or timeline[-1].updated_t != info.updated_t:
                timeline.append(info)
            while timeline and (timeline[0].updated_t or 0.0) < now - self._keep_s:
                timeline.popleft()

    def _hung(self, snapshot: Snapshot) -> dict[JobKey, Hang]:
        jobs: dict[JobKey, list[Rank]] = {}
        for rank in self._members.values():
            key = rank.job_key
            if key is not None and rank.info.updated_t is not None:
                jobs.setdefault(key, []).append(rank)
        by_uuid = {g.uuid: g for g in snapshot.gpus}
        hung = {}
        for key, members in jobs.items():
            frozen = tuple(self._frozen(rank, snapshot.t) for rank in members)
            advanced = tuple(self._advanced[r.pid][1] for r in members)
            progress = trainer_rules.JobProgress(key[1], tuple(r.info for r in members), advanced, frozen)
            finding = trainer_rules.hang(
                progress, by_uuid, self.cfg, snapshot.t, gpus_seen=snapshot.backend in PID_BACKENDS
            )
            if finding is not None:
                stuck = tuple(r for r, how in zip(members, frozen, strict=True) if how)
                hung[key] = Hang(finding, tuple(members), max(advanced), stuck)
        return hung

    def _frozen(self, rank: Rank, now: float) -> str:
        """Positive evidence that the rank's process cannot make progress, in words; "" when there is none."""
        if self.proc.run_state(rank.pid) in _STOPPED:
            return "is stopped (SIGSTOP)"
        cpu, since = self._cpu.get(rank.pid, (None, now))
        _, advanced = self._advanced.get(rank.pid, (None, now))
        quiet_s = now - max(since, advanced)
        if cpu is not None and quiet_s >= self.cfg.stale_after_s:
            return f"used no CPU time and finished no step for {quiet_s:.0f} s"
        return ""
