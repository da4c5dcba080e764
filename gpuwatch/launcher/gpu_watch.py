"""Launch's own watch on its GPUs: a job whose ranks do not report is still moved off a quarantined GPU.

The daemon stops the ranks it hears from (TrainerLink: they checkpoint and exit 75 within its grace
period). A rank it never heard from (a job without TrainerLink, a rank that lost its socket) it cannot
stop, so launch watches the daemon's GPU list itself while torchrun runs: when one of the launch's GPUs
is quarantined and the daemon holds no live report of this job on it, launch stops torchrun at once;
when it does, launch waits the daemon's grace period and a margin for the orderly stop first. A job
stopped this way loses the steps since its last checkpoint (there was no stop at a step boundary).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gpuwatch.errors import GpuwatchError

if TYPE_CHECKING:
    from gpuwatch.serving.wire import Gpu

MARGIN_S = 15.0  # after the daemon's grace period: its SIGTERM and torchrun's teardown


class StopSwitch:
    """Set once by the watch, read by the runner: stop torchrun now, and why."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self.reason: str | None = None

    def stop(self, reason: str) -> None:
        if not self._set.is_set():
            self.reason = reason
            self._set.set()

    def wait(self, timeout_s: float) -> bool:
        """True once stopped; waits at most `timeout_s`."""
        return self._set.wait(timeout_s)

    @property
    def stopped(self) -> bool:
        return self._set.is_set()


class QuarantineWatch:
    """While one torchrun runs: poll the daemon's GPUs every `poll_s`; stop the launch when one of `chosen`
    is quarantined and the job has not gone off it by itself in time (see the module docstring)."""

    def __init__(
        self,
        gpus: Callable[[], list[Gpu]],
        chosen: Sequence[Gpu],
        job_id: str,
        switch: StopSwitch,
        *,
        grace_s: float,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpus = gpus
        self.chosen = {g.uuid: g.index for g in chosen}
        self.job_id = job_id
        self.switch = switch
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.clock = clock
        self._seen: dict[str, float] = {}  # uuid → when we first saw it quarantined
        self._heard: set[str] = set()  # uuids the daemon mapped a rank of this job to, at any poll
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-launch-gpu-watch", daemon=True)

    def __enter__(self) -> QuarantineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._done.wait(self.poll_s) and not self.switch.stopped:
            try:
                now_gpus = self.gpus()
            except GpuwatchError:
                continue  # a daemon restarting: the next poll asks again
            self.check(now_gpus)

    def check(self, now_gpus: Sequence[Gpu]) -> None:
        """Stop the launch when a quarantined GPU of its own has waited long enough (see the module docstring)."""
        now = self.clock()
        for gpu in now_gpus:
            if gpu.uuid not in self.chosen:
                continue
            if self._maps_a_rank_to(gpu):
                self._heard.add(gpu.uuid)
            if not gpu.quarantined:
                continue
            first = self._seen.setdefault(gpu.uuid, now)
            reported = gpu.uuid in self._heard
            wait_s = self.grace_s + MARGIN_S if reported else 0.0
            if now - first < wait_s:
                continue
            unheard = (
                "none of its ranks there reports to the daemon"
                if not reported
                else (f"the job was still on it {wait_s:.0f} s later")
            )
            self.switch.stop(
                f"GPU {gpu.index} ({gpu.uuid}) left, quarantined: {gpu.quarantine_reason}; {unheard}, so launch "
                "stopped the job itself: the steps since its last checkpoint are lost"
            )
            return

    def _maps_a_rank_to(self, gpu: Gpu) -> bool:
        """The daemon maps a rank of this job to `gpu` (from its reports and the process table): it stops that
        rank itself. Remembered (`_heard`): a rank that stopped as asked leaves the list before torchrun ends."""
        return any(t.job_id == self.job_id for t in (*gpu.trainers, *(gpu.ranks or ())))
