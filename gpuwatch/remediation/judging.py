"""Judging the trainers: each rank's timeline, each job's progress, the trainer rules.

`judge()` runs after each publish on the sampling thread (a monitor listener); `hangs()` runs on the
remediation thread about twice a second with the reports as they are then, so a hang is found in
seconds whatever the sampling interval. Both keep only bounded in-memory state, under one lock. A
rank stays a member of its job while its process lives, even when its report goes stale; what its
process does is read from /proc, never from that silence: whether it is stopped (state T), and
when its main thread's CPU time last moved. A job is (uid, job id).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from dataclasses import dataclass

from gpuwatch.base.procfs import ProcFs
from gpuwatch.config import TrainerConfig
from gpuwatch.health import trainer_rules
from gpuwatch.model import Finding, Snapshot, TrainerInfo
from gpuwatch.node.ranks import PID_BACKENDS, JobKey, Rank

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
    """Timelines per rank, members and progress per job; `judge()` once per publish, `hangs()` between."""

    def __init__(self, cfg: TrainerConfig, proc: ProcFs) -> None:
        self.cfg = cfg
        self.proc = proc
        self._keep_s = max(cfg.fragmentation_window_s, cfg.alloc_retries_window_s, cfg.grad_var_history_s)
        self._lock = threading.Lock()
        self._timelines: dict[int, deque[TrainerInfo]] = {}
        self._members: dict[int, Rank] = {}  # pid → the rank as last seen, while its process lives
        self._advanced: dict[int, tuple[int | None, float]] = {}  # pid → (step, when it last changed)
        self._cpu: dict[int, tuple[int | None, float]] = {}  # pid → (main thread's CPU ns, when it last changed)
        self._stopped: dict[int, float] = {}  # pid → when first seen stopped (state T) since its step changed
        self._active: set[tuple[str, int]] = set()

    def judge(self, snapshot: Snapshot, ranks: list[Rank]) -> Judgement:
        """Extend the timelines with the new reports, judge every rank and job, log findings as they appear."""
        with self._lock:
            self._track(snapshot.t, ranks)
            self._extend_timelines(snapshot.t, ranks)
            verdict = trainer_rules.evaluate(self._timelines, snapshot.gpus, self.cfg, snapshot.t)
            hung = self._hung(snapshot, snapshot.t)
            findings = verdict.findings + tuple(h.finding for h in hung.values())
            active = {(f.rule, f.index) for f in findings}
            for f in findings:
                if (f.rule, f.index) not in self._active:
                    log.warning("trainer finding %s on GPU %d: %s", f.rule, f.index, f.reason)
            self._active = active
        return Judgement(trainer_rules.Verdict(findings, verdict.stragglers), hung)

    def hangs(self, now: float, ranks: list[Rank], snapshot: Snapshot) -> dict[JobKey, Hang]:
        """The hung jobs at `now`, from the ranks as their reports and step pages say now (GPUs: `snapshot`'s)."""
        with self._lock:
            self._track(now, ranks)
            return self._hung(snapshot, now)

    def stopped_verdict_in(self, now: float) -> float | None:
        """Seconds until the first rank seen stopped (state T) has been for hang_stopped_after_s; None when none
        is stopped or it has been already: the remediation thread judges again then, not up to a poll later."""
        with self._lock:
            if not self._stopped:
                return None
            due = min(self._stopped.values()) + self.cfg.hang_stopped_after_s - now
            return due if due > 0 else None

    def members(self, job: JobKey) -> list[Rank]:
        """Every live rank of `job` seen on this node."""
        with self._lock:
            return [rank for rank in self._members.values() if rank.job_key == job]

    def _track(self, now: float, ranks: list[Rank]) -> None:
        """Members, when each one's step last changed, and what its process does while it does not."""
        current = {rank.pid for rank in ranks}
        for pid, rank in list(self._members.items()):
            if pid not in current and not self.proc.alive(pid, rank.start_time):
                del self._members[pid]
                for kept in (self._advanced, self._cpu, self._stopped):
                    kept.pop(pid, None)
        for rank in ranks:
            known = self._members.get(rank.pid)
            if rank.info.updated_t is None and known is not None and known.info.updated_t is not None:
                # NVML still lists it but its link went silent (a frozen process): its last report stands.
                rank = dataclasses.replace(rank, info=known.info)
            self._members[rank.pid] = rank
            info = rank.info
            step, _ = self._advanced.get(rank.pid, (None, 0.0))
            new = rank.pid not in self._advanced
            stepped = not new and info.step != step
            if new or stepped:
                changed = info.step_t or info.updated_t  # the step page says when the step ended
                self._advanced[rank.pid] = (info.step, changed if changed is not None else now)
                self._cpu.pop(rank.pid, None)
                self._stopped.pop(rank.pid, None)
            if not stepped:
                cpu = self.proc.main_thread_cpu_ns(rank.pid)  # stalled: what does its process do?
                if rank.pid not in self._cpu or self._cpu[rank.pid][0] != cpu:
                    self._cpu[rank.pid] = (cpu, now)
            # Stopped is read after a new step too: a rank stopped right after its step counts from this poll.
            if self.proc.run_state(rank.pid) in _STOPPED:
                self._stopped.setdefault(rank.pid, now)
            else:
                self._stopped.pop(rank.pid, None)

    def _extend_timelines(self, now: float, ranks: list[Rank]) -> None:
        current = {rank.pid for rank in ranks}
        for pid in [pid for pid in self._timelines if pid not in current]:
            del self._timelines[pid]
        for rank in ranks:
            info = self._members[rank.pid].info
            if info.updated_t is None:
                continue
            timeline = self._timelines.setdefault(rank.pid, deque())
            if not timeline or timeline[-1].updated_t != info.updated_t:
                timeline.append(info)
            while timeline and (timeline[0].updated_t or 0.0) < now - self._keep_s:
                timeline.popleft()

    def _hung(self, snapshot: Snapshot, now: float) -> dict[JobKey, Hang]:
        jobs: dict[JobKey, list[Rank]] = {}
        for rank in self._members.values():
            key = rank.job_key
            if key is not None and rank.info.updated_t is not None:
                jobs.setdefault(key, []).append(rank)
        by_uuid = {g.uuid: g for g in snapshot.gpus}
        hung = {}
        for key, members in jobs.items():
            states = tuple(self._state(rank, now) for rank in members)
            advanced = tuple(self._progress_t(rank, now) for rank in members)
            progress = trainer_rules.JobProgress(key[1], tuple(r.info for r in members), advanced, states)
            finding = trainer_rules.hang(progress, by_uuid, self.cfg, now, gpus_seen=snapshot.backend in PID_BACKENDS)
            if finding is not None:
                stuck = tuple(r for r, s in zip(members, states, strict=True) if self._stuck(r, s))
                hung[key] = Hang(finding, tuple(members), max(advanced), stuck)
        return hung

    def _progress_t(self, rank: Rank, now: float) -> float:
        """When the rank last made progress: its last step, or its declared pause (now while it lasts)."""
        _, stepped = self._advanced.get(rank.pid, (None, now))
        pause_until = self._pause_until(rank, now)
        return max(stepped, min(pause_until, now)) if pause_until is not None else stepped

    def _pause_until(self, rank: Rank, now: float) -> float | None:
        """The declared pause's end, at most trainer.max_pause_s after the rank's last step (the rank's
        own word: `pause(up_to_s=1e9)` must not hide a frozen rank for good)."""
        pause_until = rank.info.pause_until
        if pause_until is None:
            return None
        _, stepped = self._advanced.get(rank.pid, (None, now))
        return min(pause_until, stepped + self.cfg.max_pause_s)

    def _state(self, rank: Rank, now: float) -> trainer_rules.RankState:
        """What the rank's process did since its last progress, from /proc (never from its silence)."""
        stopped = self._stopped.get(rank.pid)
        stopped_s = now - stopped if stopped is not None else 0.0
        pause_until = self._pause_until(rank, now)
        paused = (rank.info.pause or "a declared pause") if pause_until is not None and pause_until > now else ""
        cpu, since = self._cpu.get(rank.pid, (None, now))
        quiet_s = 0.0 if paused or cpu is None else max(0.0, now - max(since, self._progress_t(rank, now)))
        return trainer_rules.RankState(stopped_s=stopped_s, quiet_s=quiet_s, paused=paused)

    def _stuck(self, rank: Rank, state: trainer_rules.RankState) -> bool:
        """The rank is one the hang's evidence names: stopped, or still for its frozen limit (or stale_after_s)."""
        if state.stopped_s >= self.cfg.hang_stopped_after_s:
            return True
        return state.quiet_s >= min(trainer_rules.frozen_limit(rank.info, self.cfg), self.cfg.stale_after_s)
