"""Ranks as real processes for the remediation tests: each runs its signal set-up and reports what it is told."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.reporting import FakeRank

# What each kind of rank does with the stop signal and SIGTERM (Python code run before it sleeps).
BEHAVIOUR = {
    "cooperative": "signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))",
    "ignores_stop": "signal.signal(signal.SIGUSR1, signal.SIG_IGN)",
    "ignores_term": "signal.signal(signal.SIGUSR1, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)",
}
Spawn = Callable[..., FakeRank]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """`spawn(behaviour="cooperative")`: a rank process, killed (and continued, if stopped) at the end."""
    children: list[FakeRank] = []

    def start(behaviour: str = "cooperative") -> FakeRank:
        child = FakeRank(BEHAVIOUR[behaviour])
        children.append(child)
        return child

    yield start
    for child in children:
        child.end()
