"""Judging the trainers after each publish: each rank's timeline, each job's progress, the trainer rules.

Runs on the sampling thread (a monitor listener), so it only keeps bounded in-memory state. A
rank stays a member of its job while its process lives, even when its report goes stale: a frozen
rank (SIGSTOP, a wedged driver call) stops reporting, and that silence is what `trainer_hang` needs.
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
from gpuwatch.ranks import PID_BACKENDS, Rank

log = logging.getLogger("gpuwatch.remediation")


@dataclass(frozen=True)
class Judgement:
    """One round: the rules' verdict, and per hung job its finding and every rank it has on this node."""

    verdict: trainer_rules.Verdict
    hung: dict[str, tuple[Finding, tuple[Rank, ...]]]


class TrainerJudge:
    """Timelines per rank, members and progress per job; `judge()` once per publish."""

    def __init__(self, cfg: TrainerConfig, proc: ProcFs) -> None:
        self.cfg = cfg
        self.proc = proc
        self._keep_s = max(cfg.fragmentation_window_s, cfg.alloc_retries_window_s, cfg.grad_var_history_s)
        self._timelines: dict[int, deque[TrainerInfo]] = {}
        self._members: dict[int, Rank] = {}  # pid → the rank as last seen, while its process lives
        self._advanced: dict[int, tuple[int | None, float]] = {}  # pid → (step, when it last changed)
        self._active: set[tuple[str, int]] = set()

    def judge(self, snapshot: Snapshot, ranks: list[Rank]) -> Judgement:
        """Extend the timelines with the new reports, judge every rank and job, log findings as they appear."""
        self._remember(snapshot.t, ranks)
        verdict = trainer_rules.evaluate(self._timelines, snapshot.gpus, self.cfg, snapshot.t)
        hung = self._hung(snapshot)
        findings = verdict.findings + tuple(finding for finding, _ in hung.values())
        active = {(f.rule, f.index) for f in findings}
        for f in findings:
            if (f.rule, f.index) not in self._active:
                log.warning("trainer finding %s on GPU %d: %s", f.rule, f.index, f.reason)
        self._active = active
        return Judgement(trainer_rules.Verdict(findings, verdict.stragglers), hung)

    def members(self, job: str) -> list[Rank]:
        """Every live rank of `job` seen on this node."""
        return [rank for rank in self._members.values() if rank.job == job]

    def _remember(self, now: float, ranks: list[Rank]) -> None:
        current = {rank.pid for rank in ranks}
        for pid, rank in list(self._members.items()):
            if pid not in current and not self.proc.alive(pid, rank.start_time):
                del self._members[pid]
                self._advanced.pop(pid, None)
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
                self._advanced[rank.pid] = (info.step, info.updated_t if info.updated_t is not None else now)
            if info.updated_t is None:
                continue
            timeline = self._timelines.setdefault(rank.pid, deque())
            if not timeline or timeline[-1].updated_t != info.updated_t:
                timeline.append(info)
            while timeline and (timeline[0].updated_t or 0.0) < now - self._keep_s:
                timeline.popleft()

    def _hung(self, snapshot: Snapshot) -> dict[str, tuple[Finding, tuple[Rank, ...]]]:
        jobs: dict[str, list[Rank]] = {}
        for rank in self._members.values():
            if rank.job and rank.info.updated_t is not None:
                jobs.setdefault(rank.job, []).append(rank)
        by_uuid = {g.uuid: g for g in snapshot.gpus}
        hung = {}
        for job, members in jobs.items():
            progress = trainer_rules.JobProgress(
                job, tuple(r.info for r in members), tuple(self._advanced[r.pid][1] for r in members)
            )
            finding = trainer_rules.hang(
                progress, by_uuid, self.cfg, snapshot.t, gpus_seen=snapshot.backend in PID_BACKENDS
            )
            if finding is not None:
                hung[job] = (finding, tuple(members))
        return hung
