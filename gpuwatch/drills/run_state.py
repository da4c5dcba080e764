"""One drill in progress: what was asked, what the GPU looked like before, and what each step found.

Steps are closures over a Run; a later step reads what an earlier one saw (the finding's severity
decides whether a quarantine must follow), which keeps each step a small pure-ish check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwatch.config import Config
from gpuwatch.drills.daemon_client import DrillApi
from gpuwatch.drills.spec import DcgmSpec, Expectation, InjectSpec, Kind
from gpuwatch.drills.steps import Clock

if TYPE_CHECKING:  # pydantic loads with the first answer read, not with the daemon that imports the drills
    from gpuwatch.serving import wire


@dataclass
class Run:
    """Mutable on purpose: the steps of one run fill it in, in order."""

    kind: Kind
    gpu: int
    api: DrillApi
    config: Config
    clock: Clock
    before: wire.Gpu  # the target GPU as the daemon showed it when the drill was asked for
    spec: InjectSpec | DcgmSpec | None = None
    spec_text: str = ""
    rank: int | None = None
    await_release: bool = False
    trigger: str = "cli"
    expect: Expectation = field(default_factory=Expectation)
    started: float = 0.0
    finding: wire.Finding | None = None
    quarantine_expected: bool = False
    handles_released: bool = False
    back_since: float = 0.0
    clean_since: float | None = None
    victim: wire.Trainer | None = None
    fault_report: dict[str, Any] = field(default_factory=dict)

    @property
    def uuid(self) -> str:
        return self.before.uuid

    @property
    def trainers(self) -> list[wire.Trainer]:
        """The trainers on the GPU when the drill started."""
        return self.before.trainers
