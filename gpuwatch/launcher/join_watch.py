"""An in-place launch refuses a job that never joins: no `InPlaceJob` or `ShardedJob` within a bound of its start.

`gpuwatch launch --in-place` runs each worker as a job of one until the worker joins the job's
membership (gpuwatch.inplace). A script that never joins (a Hugging Face or Lightning Trainer owns
its process group; a plain torchrun script waits for MASTER_ADDR) would train alone on every GPU,
or crash and be replaced over and over. So until the first JOIN event, the launch watches: every
worker it started ended before any joined, or none joined within `within_s`, and it stops the
job with one line (exit 2), before any replacement or any other GPU.
"""

from __future__ import annotations

import time
from typing import Any

DEFAULT_JOIN_WITHIN_S = 120.0
_READ_EVERY_S = 0.2  # the store's event log, read this often until the first join
WHAT_TO_RUN = (
    "a script that uses gpuwatch.inplace.InPlaceJob (or ShardedJob) runs with --in-place; any other "
    "(HF Trainer, Lightning, torchrun scripts) with `gpuwatch launch` without --in-place (docs/frameworks.md)"
)


class JoinWatch:
    """Whether an in-place job has joined yet, from the job's event log; why to refuse it when it never does."""

    def __init__(self, store: Any, within_s: float = DEFAULT_JOIN_WITHIN_S, started_t: float | None = None) -> None:
        self.store = store
        self.within_s = within_s
        self.started_t = time.monotonic() if started_t is None else started_t
        self.joined = False
        self._seen = 0
        self._next_read = 0.0

    def refusal(self, live_workers: int, now: float | None = None) -> str | None:
        """Why the job must stop now (one line), or None: it joined, or may still join."""
        now = time.monotonic() if now is None else now
        if self.joined or (live_workers and now < self._next_read):
            return None
        self._next_read = now + _READ_EVERY_S
        # Here, not at the top: gpuwatch.inplace imports torch, and `gpuwatch launch` (which reads this
        # module's default) must start, and say what is missing, in a Python without it.
        from gpuwatch.inplace.protocol import JOIN, read_events

        events = read_events(self.store, self._seen)
        self._seen += len(events)
        if any(isinstance(e, dict) and e.get("kind") == JOIN for e in events):
            self.joined = True
            return None
        if live_workers == 0:
            return f"every worker ended before any joined the job: {WHAT_TO_RUN}"
        if now - self.started_t >= self.within_s:
            return f"no worker joined the job within {self.within_s:g} s of its start: {WHAT_TO_RUN}"
        return None
