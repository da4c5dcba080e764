"""One drill in progress: what was asked, what the GPU looked like before, and what each step found.

Steps are closures over a Run; a later step reads what an earlier one saw (the finding's severity
decides whether a quarantine must follow), which keeps each step a small pure-ish check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwatch.config import Config
from gpuwatch.drills.daemon_client import DrillApi
from gpuwatch.drills.spec import DcgmSpec, Expectation, InjectSpec, Kind
from gpuwatch.drills.steps import Clock


@dataclass
class Run:
    """Mutable on purpose: the steps of one run fill it in, in order."""

    kind: Kind
    gpu: int
    api: DrillApi
    config: Config
    clock: Clock
    spec: InjectSpec | DcgmSpec | None = None
    spec_text: str = ""
    rank: int | None = None
    await_release: bool = False
    trigger: str = "cli"
    before: dict[str, Any] = field(default_factory=dict)
    expect: Expectation = field(default_factory=Expectation)
    started: float = 0.0
    finding: dict[str, Any] | None = None
    quarantine_expected: bool = False
    handles_released: bool = False
    back_since: float = 0.0
    clean_since: float | None = None
    victim: dict[str, Any] | None = None
    fault_report: dict[str, Any] = field(default_factory=dict)

    @property
    def uuid(self) -> str:
        return str(self.before.get("uuid", ""))

    @property
    def trainers(self) -> list[dict[str, Any]]:
        """The trainers on the GPU when the drill started."""
        return list(self.before.get("trainers", []))
