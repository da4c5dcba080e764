"""state.py: hysteresis, quarantine and burn-in, operator actions, epochs, the circuit breaker, drills."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from gpuwatch.config import PolicyConfig
from gpuwatch.health import state
from gpuwatch.health.state import Decision, NodeState
from gpuwatch.model import Finding, Health, Severity

POLICY = PolicyConfig()  # recovery 120 s, degraded quarantine after 900 s, burn-in 1800 s, breaker 25% / 3600 s
DEGRADED = Finding("thermal_margin_low", Severity.DEGRADED, "hot")
UNHEALTHY = Finding("xid_critical", Severity.UNHEALTHY, "XID 79")
WARNING = Finding("xid_app", Severity.WARNING, "XID 31")


def advance(
    node: NodeState, now: float, findings: Mapping[int, Sequence[Finding]], policy: PolicyConfig = POLICY
) -> tuple[NodeState, list[Decision]]:
    return state.step(node, findings, now, policy)


def gpu(node: NodeState, index: int = 0) -> state.GpuState:
    return next(g for g in node.gpus if g.index == index)


def kinds(decisions: list[Decision]) -> list[tuple[str, int]]:
    return [(d.kind, d.index) for d in decisions]


def test_unknown_until_judged() -> None:
    node = state.initial([0, 1])
    node, decisions = advance(node, 0, {0: []})
    assert gpu(node, 0).state is Health.HEALTHY
    assert gpu(node, 1).state is Health.UNKNOWN
    assert [(d.kind, d.state) for d in decisions] == [("state", Health.HEALTHY)]


def test_info_and_warning_leave_it_healthy() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [WARNING]})
    assert gpu(node).state is Health.HEALTHY


def test_worse_at_once() -> None:
    node, _ = advance(state.initial([0]), 0, {0: []})
    node, decisions = advance(node, 10, {0: [DEGRADED]})
    assert gpu(node).state is Health.DEGRADED and gpu(node).bad_since == 10
    assert decisions[0].reason == "healthy → degraded: thermal_margin_low: hot"
    node, decisions = advance(node, 20, {0: [DEGRADED, UNHEALTHY]})
    assert gpu(node).state is Health.UNHEALTHY and gpu(node).bad_since == 10
    assert decisions[0].kind == "state" and decisions[0].state is Health.UNHEALTHY


def test_better_only_after_recovery_time() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [DEGRADED]})
    for t in (30, 60, 149):
        node, decisions = advance(node, t, {0: []})
        assert gpu(node).state is Health.DEGRADED and decisions == []
    node, decisions = advance(node, 150, {0: []})
    assert gpu(node).state is Health.HEALTHY and gpu(node).bad_since is None
    assert decisions[0].reason == "degraded → healthy: no degraded-or-worse finding for 120 s"


def test_a_relapse_restarts_recovery() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [DEGRADED]})
    node, _ = advance(node, 30, {0: []})
    node, _ = advance(node, 100, {0: [DEGRADED]})
    node, _ = advance(node, 130, {0: []})
    node, _ = advance(node, 200, {0: []})
    assert gpu(node).state is Health.DEGRADED  # clean only since 130
    node, _ = advance(node, 250, {0: []})
    assert gpu(node).state is Health.HEALTHY


def test_never_better_on_one_good_sample() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]}, replace(POLICY, quarantine_on_unhealthy=False))
    node, _ = advance(node, 1000, {0: []})
    assert gpu(node).state is Health.UNHEALTHY


def test_unhealthy_recovers_through_degraded() -> None:
    policy = replace(POLICY, quarantine_on_unhealthy=False)
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]}, policy)
    node, _ = advance(node, 10, {0: [DEGRADED]}, policy)
    node, _ = advance(node, 129, {0: [DEGRADED]}, policy)
    assert gpu(node).state is Health.UNHEALTHY
    node, decisions = advance(node, 130, {0: [DEGRADED]}, policy)
    assert gpu(node).state is Health.DEGRADED
    assert decisions[0].reason == "unhealthy → degraded: no unhealthy finding for 120 s"
    node, _ = advance(node, 200, {0: []}, policy)
    node, _ = advance(node, 320, {0: []}, policy)
    assert gpu(node).state is Health.HEALTHY


def test_unhealthy_quarantines_at_once() -> None:
    node, decisions = advance(state.initial([0]), 0, {0: [UNHEALTHY]})
    assert kinds(decisions) == [("state", 0), ("quarantine", 0)]
    g = gpu(node)
    assert g.quarantined and g.quarantine_auto and g.epoch == 1 and g.quarantined_since == 0
    assert decisions[1].auto and decisions[1].reason == "unhealthy: xid_critical: XID 79"


def test_unhealthy_without_quarantine_on_unhealthy_waits_like_degraded() -> None:
    policy = replace(POLICY, quarantine_on_unhealthy=False)
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]}, policy)
    assert not gpu(node).quarantined
    node, _ = advance(node, 900, {0: [UNHEALTHY]}, policy)
    assert gpu(node).quarantined


def test_degraded_quarantines_after_configured_time() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [DEGRADED]})
    node, decisions = advance(node, 899, {0: [DEGRADED]})
    assert not gpu(node).quarantined and decisions == []
    node, decisions = advance(node, 900, {0: [DEGRADED]})
    assert kinds(decisions) == [("quarantine", 0)]
    assert decisions[0].reason == "degraded for 900 s: thermal_margin_low: hot"


def test_flapping_degraded_still_quarantines() -> None:
    """Hysteresis keeps a card that flaps degraded/clean degraded, so its episode keeps counting."""
    node = state.initial([0])
    for t in range(0, 901, 60):
        node, _ = advance(node, t, {0: [DEGRADED] if t % 120 == 0 else []})
    assert gpu(node).quarantined


def test_burn_in_releases_auto_quarantine() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]})
    node, _ = advance(node, 100, {0: []})
    node, _ = advance(node, 1899, {0: []})
    assert gpu(node).quarantined and gpu(node).state is Health.HEALTHY
    node, decisions = advance(node, 1900, {0: []})
    assert kinds(decisions) == [("release", 0)]
    assert decisions[0].auto and decisions[0].reason == "burn-in: no degraded-or-worse finding for 1800 s"
    assert not gpu(node).quarantined and gpu(node).epoch == 1


def test_burn_in_restarts_on_a_bad_finding() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]})
    node, _ = advance(node, 100, {0: []})
    node, _ = advance(node, 1000, {0: [DEGRADED]})
    node, _ = advance(node, 1100, {0: []})
    node, _ = advance(node, 2000, {0: []})
    assert gpu(node).quarantined
    node, _ = advance(node, 2900, {0: []})
    assert not gpu(node).quarantined


def test_operator_quarantine_is_not_burned_in() -> None:
    node, _ = advance(state.initial([0]), 0, {0: []})
    node, decisions = state.quarantine(node, 0, "maintenance", 10)
    assert kinds(decisions) == [("quarantine", 0)] and not decisions[0].auto
    assert gpu(node).epoch == 1 and not gpu(node).quarantine_auto
    for t in range(100, 10_000, 600):
        node, decisions = advance(node, t, {0: []})
        assert decisions == []
    assert gpu(node).quarantined
    node, decisions = state.release(node, 0, 10_000)
    assert kinds(decisions) == [("release", 0)] and not decisions[0].auto and decisions[0].reason == "operator"
    assert not gpu(node).quarantined and gpu(node).epoch == 1


def test_operator_takes_over_an_auto_quarantine() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]})
    node, decisions = state.quarantine(node, 0, "keep it out", 50)
    assert kinds(decisions) == [("quarantine", 0)] and not decisions[0].auto
    assert gpu(node).epoch == 1 and not gpu(node).quarantine_auto
    node, _ = advance(node, 100, {0: []})
    node, _ = advance(node, 5000, {0: []})
    assert gpu(node).quarantined
    assert state.quarantine(node, 0, "again", 5001) == (node, [])


def test_release_of_a_free_gpu_does_nothing() -> None:
    node = state.initial([0])
    assert state.release(node, 0, 0) == (node, [])


def test_operator_release_holds_off_auto_quarantine_for_the_episode() -> None:
    policy = replace(POLICY, breaker_max_share=1.0)  # room for a second auto quarantine within the hour
    node, _ = advance(state.initial([0, 1]), 0, {0: [UNHEALTHY]}, policy)
    node, _ = state.release(node, 0, 10)
    node, decisions = advance(node, 20, {0: [UNHEALTHY]}, policy)
    assert not gpu(node).quarantined and decisions == []
    node, _ = advance(node, 30, {0: []}, policy)
    node, _ = advance(node, 200, {0: []}, policy)
    assert gpu(node).state is Health.HEALTHY
    node, decisions = advance(node, 210, {0: [UNHEALTHY]}, policy)
    assert kinds(decisions) == [("state", 0), ("quarantine", 0)]
    assert gpu(node).epoch == 2


def test_epoch_bumps_on_every_quarantine() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [UNHEALTHY]})
    node, _ = state.release(node, 0, 1)
    node, _ = state.quarantine(node, 0, "operator", 2)
    node, _ = state.release(node, 0, 3)
    node, _ = state.quarantine(node, 0, "operator", 4)
    assert gpu(node).epoch == 3


def test_breaker_refuses_beyond_its_share_then_allows_after_the_window() -> None:
    node = state.initial(range(8))
    node, decisions = advance(node, 0, {i: [UNHEALTHY] if i < 2 else [] for i in range(8)})
    assert [d.index for d in decisions if d.kind == "quarantine"] == [0, 1]
    assert node.breaker_tripped  # two of two allowed are used
    node, decisions = advance(node, 10, {2: [UNHEALTHY]})
    refused = [d for d in decisions if d.kind == "refused"]
    assert [d.index for d in refused] == [2] and not gpu(node, 2).quarantined
    assert refused[0].reason.startswith("circuit breaker refused the quarantine: 2 automatic quarantine(s)")
    assert "limit of 2 (25% of 8 GPUs)" in refused[0].reason
    assert node.breaker_refusals == 1 and node.breaker_tripped
    node, decisions = advance(node, 20, {2: [UNHEALTHY]})
    assert decisions == [] and node.breaker_refusals == 1  # refused once per episode, not every round
    node, decisions = advance(node, 3599, {2: [UNHEALTHY]})
    assert not gpu(node, 2).quarantined
    node, decisions = advance(node, 3600, {2: [UNHEALTHY]})
    assert kinds(decisions) == [("quarantine", 2)] and gpu(node, 2).quarantined
    assert not node.breaker_tripped and node.auto_quarantines == (3600,)


def test_operator_quarantine_bypasses_the_breaker() -> None:
    node = state.initial(range(4))
    node, _ = advance(node, 0, {0: [UNHEALTHY]})
    assert node.breaker_tripped  # max(1, ⌊0.25 × 4⌋) = 1
    node, decisions = state.quarantine(node, 3, "operator", 5)
    assert kinds(decisions) == [("quarantine", 3)] and node.auto_quarantines == (0,)


def test_auto_quarantine_through_the_api_needs_the_breaker_policy() -> None:
    node = state.initial([0, 1, 2, 3])
    with pytest.raises(ValueError):
        state.quarantine(node, 0, "drill", 0, auto=True)
    node, decisions = state.quarantine(node, 0, "drill", 0, auto=True, drill=True, policy=POLICY)
    assert kinds(decisions) == [("quarantine", 0)] and decisions[0].drill
    node, decisions = state.quarantine(node, 1, "drill", 1, auto=True, policy=POLICY)
    assert kinds(decisions) == [("refused", 1)]


@pytest.mark.parametrize(("n", "share", "limit"), [(8, 0.25, 2), (4, 0.25, 1), (1, 0.25, 1), (10, 0.3, 3), (8, 1.0, 8)])
def test_breaker_limit(n: int, share: float, limit: int) -> None:
    assert state.breaker_limit(n, replace(POLICY, breaker_max_share=share)) == limit


def test_unknown_gpu() -> None:
    node = state.initial([0])
    with pytest.raises(KeyError):
        state.quarantine(node, 7, "x", 0)
    with pytest.raises(KeyError):
        state.release(node, 7, 0)


def test_drill_findings_drive_the_machine_and_mark_decisions() -> None:
    drill = replace(UNHEALTHY, drill=True)
    node, decisions = advance(state.initial([0]), 0, {0: [drill]})
    assert kinds(decisions) == [("state", 0), ("quarantine", 0)]
    assert all(d.drill for d in decisions)
    node, _ = advance(node, 10, {0: []})
    node, decisions = advance(node, 130, {0: []})
    assert decisions[0].kind == "state" and decisions[0].drill  # the recovery belongs to the drill too
    node, decisions = advance(node, 1810, {0: []})
    assert kinds(decisions) == [("release", 0)] and decisions[0].drill


def test_a_real_finding_during_a_drill_makes_it_real() -> None:
    node, _ = advance(state.initial([0]), 0, {0: [replace(DEGRADED, drill=True)]})
    assert gpu(node).drill
    node, decisions = advance(node, 10, {0: [replace(DEGRADED, drill=True), UNHEALTHY]})
    assert not gpu(node).drill
    assert all(not d.drill for d in decisions)


def test_a_gate_refuses_once_per_episode_then_allows_and_never_sees_operator_quarantines() -> None:
    asked: list[tuple[int, str]] = []
    answer: list[str | None] = ["fleet says no"]

    def gate(index: int, reason: str) -> str | None:
        asked.append((index, reason))
        return answer[0]

    node, _ = advance(state.initial([0, 1]), 0, {0: [], 1: []})
    node, decisions = state.step(node, {0: [UNHEALTHY], 1: []}, 10, POLICY, gate)
    refused = [d for d in decisions if d.kind == "refused"]
    assert [d.index for d in refused] == [0] and not gpu(node, 0).quarantined
    assert (
        refused[0].reason
        == "fleet breaker refused the quarantine: fleet says no; wanted for unhealthy: xid_critical: XID 79"
    )
    assert node.breaker_refusals == 0 and not node.breaker_tripped and node.auto_quarantines == ()  # not the node's
    node, decisions = state.step(node, {0: [UNHEALTHY], 1: []}, 20, POLICY, gate)
    assert decisions == [] and len(asked) == 2  # asked again every round, reported once
    answer[0] = None
    node, decisions = state.step(node, {0: [UNHEALTHY], 1: []}, 30, POLICY, gate)
    assert kinds(decisions) == [("quarantine", 0)] and node.auto_quarantines == (30,)
    node, _ = state.quarantine(node, 1, "operator", 40)
    assert gpu(node, 1).quarantined and len(asked) == 3


def test_the_node_breaker_is_asked_before_the_gate() -> None:
    asked: list[int] = []

    def gate(index: int, reason: str) -> None:
        asked.append(index)

    policy = replace(POLICY, breaker_max_share=0.5)  # 1 of 2
    node, _ = advance(state.initial([0, 1]), 0, {0: [], 1: []})
    node, _ = state.step(node, {0: [UNHEALTHY], 1: []}, 10, policy, gate)
    node, decisions = state.step(node, {0: [UNHEALTHY], 1: [UNHEALTHY]}, 20, policy, gate)
    assert asked == [0] and decisions[-1].reason.startswith("circuit breaker refused")
