"""What the training loop told the link of its steps: the step page's slots, recent step times, the pause.

The step page (channel.py) gets the step at once, so the daemon and the launcher read it even
after a SIGKILL; the report carries the figures below. Locking: none. Only the training thread
writes (`record`, `pause`), with no syscall; the link's thread reads the figures, copying each
deque with one C call (atomic under the GIL) before it looks inside.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from gpuwatch.trainer.channel import StepPageWriter
from gpuwatch.trainer.contract import FIRST_STEP_SLOT, FIRST_STEP_T_SLOT, PAUSE_UNTIL_SLOT, STEP_SLOT, STEP_T_SLOT

STEP_TIME_WINDOW = 100  # the p99 step time is over these; the mean over the last MEAN_STEPS
MEAN_STEPS = 20
GRAD_NORM_WINDOW = 100


class StepRecord:
    """This rank's steps as the loop reported them, written through to its step page."""

    def __init__(self, page: StepPageWriter) -> None:
        self._ints, self._floats = page.ints, page.floats
        self.step: int | None = None
        self.first_step: int | None = None
        self.first_step_t: float | None = None
        self.step_wall_t: float | None = None
        self.step_times: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        self.grad_norms: deque[float] = deque(maxlen=GRAD_NORM_WINDOW)
        self.pause: str | None = None  # the pause the loop is in (TrainerLink.pause)
        self.pause_until: float | None = None

    def record(self, step: int, grad_norm: float | None) -> bool:
        """`step` finished now; True when it is the first of this process."""
        wall = time.time()
        if self.step_wall_t is not None:
            self.step_times.append(max(0.0, wall - self.step_wall_t))  # a clock stepped back counts as 0
        self.step_wall_t = wall
        self._ints[STEP_SLOT] = step
        self._floats[STEP_T_SLOT] = wall
        self.step = step
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        if self.first_step is None:
            self.first_step = self._ints[FIRST_STEP_SLOT] = step
            self.first_step_t = self._floats[FIRST_STEP_T_SLOT] = wall
            return True
        return False

    def set_pause(self, reason: str | None, until: float) -> None:
        """The pause the loop is in (None: none) and until when it may last; the page says it at once."""
        self.pause, self.pause_until = reason, until
        self._floats[PAUSE_UNTIL_SLOT] = until

    def step_time_s(self) -> float | None:
        """The mean of the last MEAN_STEPS step times."""
        step_times = self.step_times.copy()
        return statistics.fmean(list(step_times)[-MEAN_STEPS:]) if step_times else None

    def step_time_p99_s(self) -> float | None:
        """The nearest-rank 99th percentile (of 100 step times: the second largest), None without any."""
        values = self.step_times.copy()
        if not values:
            return None
        ordered = sorted(values)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    def grad_norm(self) -> float | None:
        """The last gradient norm (strict JSON has no NaN or Infinity: those are null)."""
        norms = self.grad_norms.copy()
        return (norms[-1] if math.isfinite(norms[-1]) else None) if norms else None

    def grad_norm_var(self) -> float | None:
        """The variance of the last GRAD_NORM_WINDOW finite gradient norms."""
        finite = [g for g in self.grad_norms.copy() if math.isfinite(g)]
        return statistics.pvariance(finite) if finite else None
