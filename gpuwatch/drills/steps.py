"""Steps with deadlines, run in order, and the verdict they add up to.

A step is an action (run once) or a wait (polled until it holds or its deadline passes). The
first failed step breaks the chain: later steps do not run, except `always` steps that put back
what an earlier step took (NVML handles), so a failed drill never leaves the node worse off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gpuwatch.errors import GpuwatchError

log = logging.getLogger("gpuwatch.drills")

PASS, FAIL, SKIP, NOT_RUN = "pass", "fail", "skip", "not_run"


@dataclass(frozen=True)
class Skip:
    """The step does not apply to this run (no trainer on the GPU, a finding that quarantines nothing)."""

    reason: str


@dataclass(frozen=True)
class Pending:
    """Not yet; `seen` says what the daemon showed instead, for the failure message."""

    seen: str


Outcome = str | Skip | Pending
Deadline = float | Callable[[], float] | None
Progress = Callable[[str, float, float | None], None]


class Interrupted(Exception):
    """The operator pressed Ctrl-C or the daemon is stopping: the step fails, `always` steps still run."""


@dataclass(frozen=True)
class Step:
    """`check` returns a pass detail, a Skip or a Pending, or raises a GpuwatchError (a fail)."""

    name: str
    plan: str
    check: Callable[[], Outcome]
    deadline: Deadline = None  # None: an action, run once; else seconds to keep polling
    always: bool = False


@dataclass(frozen=True)
class StepResult:
    name: str
    result: str
    duration_s: float
    detail: str
    deadline_s: float | None = None


@dataclass(frozen=True)
class Verdict:
    """One drill run: every step's result, and the step where the chain broke."""

    drill: str
    gpu: int
    uuid: str
    spec: str
    trigger: str
    started: float
    finished: float
    steps: tuple[StepResult, ...]

    @property
    def result(self) -> str:
        return FAIL if self.broke_at else PASS

    @property
    def broke_at(self) -> str | None:
        return next((s.name for s in self.steps if s.result == FAIL), None)

    def as_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body.update(result=self.result, broke_at=self.broke_at, steps=[asdict(s) for s in self.steps])
        return body


@dataclass(frozen=True)
class Clock:
    """Time as the drill sees it: real in production, a fake the tests advance."""

    now: Callable[[], float]
    sleep: Callable[[float], None]
    poll_s: float


def execute(steps: list[Step], clock: Clock, progress: Progress | None = None) -> tuple[StepResult, ...]:
    """Run `steps` in order; after the first failure only `always` steps run."""
    results: list[StepResult] = []
    broke_at: str | None = None
    for step in steps:
        if broke_at is not None and not step.always:
            results.append(StepResult(step.name, NOT_RUN, 0.0, f"the chain broke at {broke_at}"))
            continue
        result = _run(step, clock, progress)
        level = logging.WARNING if result.result == FAIL else logging.INFO
        log.log(level, "drill step %s: %s in %.2f s: %s", step.name, result.result, result.duration_s, result.detail)
        results.append(result)
        if result.result == FAIL and broke_at is None:
            broke_at = step.name
    return tuple(results)


def deadline_of(step: Step) -> float | None:
    return step.deadline() if callable(step.deadline) else step.deadline


def _run(step: Step, clock: Clock, progress: Progress | None) -> StepResult:
    start = clock.now()
    deadline = deadline_of(step)

    def done(result: str, detail: str) -> StepResult:
        return StepResult(step.name, result, round(clock.now() - start, 3), detail, deadline)

    while True:
        if progress is not None:
            progress(step.name, clock.now() - start, deadline)
        try:
            outcome = step.check()
            if isinstance(outcome, Pending) and deadline is not None and clock.now() - start < deadline:
                clock.sleep(clock.poll_s)
                continue
        except GpuwatchError as exc:  # a refused action, a tool that failed, a daemon that did not answer
            return done(FAIL, str(exc))
        except (Interrupted, KeyboardInterrupt) as exc:
            return done(FAIL, f"interrupted: {exc}" if str(exc) else "interrupted by the operator")
        if isinstance(outcome, str):
            return done(PASS, outcome)
        if isinstance(outcome, Skip):
            return done(SKIP, outcome.reason)
        return done(FAIL, outcome.seen if deadline is None else f"not within {deadline:g} s: {outcome.seen}")
