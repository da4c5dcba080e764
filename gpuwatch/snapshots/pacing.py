"""When the next host snapshot is due, and the K that `every="auto"` picks from the loop's step intervals.

HostSnapshot keeps one `Pacing`; it holds the loop's step intervals (looptime.py), the step of the
last snapshot, and what the last measured snapshot cost. Locking: none; only the training thread
(inside `HostSnapshot.step` and the calls that take a snapshot) reads or changes it.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

from gpuwatch.snapshots.cadence import choose_every, parse_every
from gpuwatch.snapshots.looptime import LoopTime

log = logging.getLogger("gpuwatch.snapshots")

AUTO_WARMUP_STEPS = 3
"""With every="auto": step intervals measured before the first snapshot (its cost is judged against them)."""


class Measured(Protocol):
    """What a committed snapshot tells the pacing: the steps it was in flight for and its times."""

    intervals: list[float]
    host_s: float
    worker_s: float


class Pacing:
    """The cadence of one rank's snapshots: K as given or chosen, the last snapshot's step, what they cost."""

    def __init__(self, every: int | str, *, share: float, max_every: int) -> None:
        self.restart(every)
        self.share, self.max_every = share, max_every
        choose_every(1.0, 1.0, share=share, max_every=max_every)  # validates both
        self.auto_basis: tuple[float, float] | None = None  # with "auto": (cost_s, step_s) it chose K from
        self.last_cost_s: float | None = None
        self.last_host_s: float | None = None

    def restart(self, every: int | str) -> None:
        """Another cadence, measured afresh (the bench compares cadences on one HostSnapshot)."""
        self.every = parse_every(every)
        self.auto = self.every is None
        self.time = LoopTime()  # the loop's step intervals: what snapshots cost its wall time
        self.wall_floor = 0  # with "auto": the least K the measured wall-time share allows
        self.last_snap_step: int | None = None
        self.waits = 0  # snapshots that came due while the previous one still drained (a fixed K under the floor)
        self.wait_s = 0.0  # what the training thread waited for those commits
        self.defers = 0  # snapshots that came due while a staged drain ran and started at its commit instead
        self._deferring = False  # a snapshot is due and waits for the staged drain in flight to commit

    def started(self, step: int) -> None:
        """A snapshot of `step` started: the next one is due K steps on."""
        self.last_snap_step = step
        self._deferring = False

    def due(self, step: int, *, window: bool, idle: bool) -> bool:
        """Whether a snapshot of `step` is due (`window`: the slots are being set up; `idle`: none in flight)."""
        if self.every is None and not window:
            return idle and self.time.plain_steps >= AUTO_WARMUP_STEPS
        every = self.every or self.max_every  # "auto" in the set-up window: its largest K keeps the bound
        last = self.last_snap_step if self.last_snap_step is not None else 0
        return step - last >= every

    def committed(self, job: Measured, state_bytes: int) -> None:
        """A snapshot taken outside the set-up window committed: its cost, and "auto"'s K from it."""
        cost = self.time.snapshot_done(job.intervals, job.host_s, job.worker_s)
        if cost is not None:
            self.last_cost_s, self.last_host_s = cost, job.host_s
            if self.auto:
                self._choose_every(state_bytes)

    def waited(self, step: int, seconds: float) -> None:
        """The snapshot of `step` came due before the previous one committed (a fixed K under the drain's floor;
        not in the staged mode: `deferred`), and the training thread waited `seconds` for that commit. Said once
        per cadence: such a K costs the loop the rest of each drain, and nothing else says why."""
        self.waits += 1
        self.wait_s += seconds
        if self.waits == 1:
            log.warning(
                "host snapshot of step %d waited %.3f s for the previous one's commit: every %s step(s) is under "
                "the drain's floor (a drain spans %s); a larger K, or every=\"auto\", never waits",
                step, seconds, self.every, self._spans(),
            )  # fmt: skip

    def deferred(self, step: int) -> None:
        """The snapshot due at `step` came while the previous one's staged drain still ran: it starts at that
        commit instead (the drain goes a portion a step; finishing it at once held the step 3x on an H100).
        Said once per cadence, since snapshots then land once a drain, not every K steps."""
        if self._deferring:
            return
        self._deferring = True
        self.defers += 1
        if self.defers == 1:
            log.warning(
                "host snapshot due at step %d starts when the previous one's drain commits: every %s step(s) is "
                "under the drain's floor (a drain spans %s), so snapshots land once a drain; every=\"auto\" "
                "picks a K at or above it",
                step, self.every, self._spans(),
            )  # fmt: skip

    def _spans(self) -> str:
        drain_steps = self.drain_steps()
        return f"about {drain_steps} step(s)" if drain_steps else "more steps than K"

    def drain_steps(self) -> int | None:
        """The steps a snapshot's drain spans (None until one was measured)."""
        step_s, drain_s = self.time.plain_step() or self.time.mean_step(), self.time.median_drain()
        return math.ceil(drain_s / step_s) if step_s and drain_s is not None else None

    def loss_bound(self) -> int | None:
        """Steps a death with no survivor loses at most: the steps between two snapshots (K, or a drain's steps
        where K is under them), plus the steps a drain spans (the one in flight is not committed yet). None
        until a snapshot was measured."""
        drain_steps = self.drain_steps()
        if not self.every or drain_steps is None:
            return None
        return max(self.every, drain_steps) + drain_steps

    def _choose_every(self, state_bytes: int) -> None:
        """ "auto": the K that keeps what snapshots cost the loop's wall time under the share (looptime.py)."""
        step_s, cost_s = self.time.median_plain_step(), self.time.mean_cost()
        assert step_s is not None and cost_s is not None
        drain_s = self.time.median_drain() or 0.0
        every = choose_every(max(0.0, cost_s), step_s, share=self.share, max_every=self.max_every,
                             background_s=drain_s)  # fmt: skip
        measured = self.time.wall_share()
        if self.every and measured is not None and measured > self.share and self.time.since_restart >= 3 * self.every:
            self.wall_floor = min(self.max_every, math.ceil(self.every * measured / self.share))
        every = max(every, self.wall_floor)  # a K the wall time showed too short is not chosen again
        self.auto_basis = (max(0.0, cost_s), step_s)
        if every != self.every:
            log.info(
                "host snapshot of %s costs the loop %.4f s per snapshot (%d measured) of a %.4f s step, drains in "
                "%.3f s: every %d step(s) keeps it under %g %%",
                size_text(state_bytes), cost_s, len(self.time.costs), step_s, drain_s, every, self.share * 100,
            )  # fmt: skip
            self.time.restart_window()
        self.every = every


def size_text(nbytes: int) -> str:
    """A size for a log line: GiB from 256 MiB up, else MiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"
