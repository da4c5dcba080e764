"""The membership rules, fed events as the launchers and ranks write them (no store, no processes)."""

from __future__ import annotations

from gpuwatch.inplace.coordinator import Coordinator
from gpuwatch.inplace.protocol import Generation


def _started(coordinator: Coordinator, *members: str, node: int = 0) -> None:
    coordinator.apply([{"kind": "node", "node": node, "workers": len(members)}])
    coordinator.apply({"kind": "join", "member": m, "node": node} for m in members)


def test_the_first_generation_waits_for_every_launcher_and_its_workers() -> None:
    coordinator = Coordinator(expected_nodes=2)
    _started(coordinator, "n0.g0.0", "n0.g1.1", node=0)
    assert coordinator.next_generation(1.0) is None  # node 1 has not said how many it started
    coordinator.apply([{"kind": "node", "node": 1, "workers": 2}, {"kind": "join", "member": "n1.g0.0", "node": 1}])
    assert coordinator.next_generation(2.0) is None  # b1 is not up yet
    coordinator.apply([{"kind": "join", "member": "n1.g1.1", "node": 1}])
    first = coordinator.next_generation(3.0)
    assert first is not None and (first.number, first.members, first.fresh) == (
        1,
        ("n0.g0.0", "n0.g1.1", "n1.g0.0", "n1.g1.1"),
        True,
    )
    assert coordinator.next_generation(4.0) is None


def test_a_worker_that_died_before_joining_does_not_hold_the_first_generation() -> None:
    coordinator = Coordinator()
    coordinator.apply([{"kind": "node", "node": 0, "workers": 2}, {"kind": "join", "member": "n0.g0.0"}])
    coordinator.apply([{"kind": "gone", "member": "n0.g1.1", "code": -9, "node": 0}])
    first = coordinator.next_generation(1.0)
    assert first is not None and first.members == ("n0.g0.0",)


def test_gone_and_leaving_members_drop_out_at_once_survivors_keep_their_order_joiners_come_last() -> None:
    coordinator = Coordinator()
    _started(coordinator, "n0.g0.0", "n0.g1.1", "n0.g2.2")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "n0.g0.0", "code": -9, "node": 0}])
    second = coordinator.next_generation(1.0)
    assert second == Generation(2, ("n0.g1.1", "n0.g2.2"), gone=("n0.g0.0",), reason="gone n0.g0.0", t=1.0)
    coordinator.apply([{"kind": "leave", "member": "n0.g2.2"}, {"kind": "join", "member": "n0.g0.3"}])
    third = coordinator.next_generation(2.0)
    assert third is not None and (third.members, third.left, third.joined) == (
        ("n0.g1.1", "n0.g0.3"),
        ("n0.g2.2",),
        ("n0.g0.3",),
    )
    assert not third.fresh  # m1 holds the state: the joiner gets it from m1
    coordinator.apply(
        [{"kind": "gone", "member": "n0.g2.2", "code": 75, "node": 0}]
    )  # the leaver's exit changes nothing more
    assert coordinator.next_generation(3.0) is None


def test_when_every_live_member_failed_the_same_members_form_a_new_group() -> None:
    coordinator = Coordinator()
    _started(coordinator, "n0.g0.0", "n0.g1.1", "n0.g2.2")
    coordinator.next_generation(0.0)
    coordinator.apply(
        [{"kind": "failed", "member": "n0.g0.0", "gen": 1}, {"kind": "failed", "member": "n0.g1.1", "gen": 1}]
    )
    assert coordinator.next_generation(1.0) is None  # m2 has not failed: it may be the one that hangs
    coordinator.apply([{"kind": "failed", "member": "n0.g2.2", "gen": 1}])
    again = coordinator.next_generation(2.0)
    assert again is not None and (again.number, again.members) == (2, ("n0.g0.0", "n0.g1.1", "n0.g2.2"))


def test_no_survivor_is_an_empty_generation_and_the_next_joiners_start_fresh() -> None:
    coordinator = Coordinator()
    _started(coordinator, "n0.g0.0")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "n0.g0.0", "code": -9, "node": 0}])
    empty = coordinator.next_generation(1.0)
    assert empty is not None and empty.members == ()
    coordinator.apply([{"kind": "join", "member": "n0.g0.3"}])
    fresh = coordinator.next_generation(2.0)
    assert fresh is not None and fresh.members == ("n0.g0.3",) and fresh.fresh  # rank 0 loads the checkpoint


def test_a_member_that_finished_ends_the_decisions() -> None:
    coordinator = Coordinator()
    _started(coordinator, "n0.g0.0", "n0.g1.1")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "n0.g0.0", "code": 0, "node": 0}])
    assert coordinator.next_generation(1.0) is None


def test_a_generation_round_trips_through_json() -> None:
    generation = Generation(3, ("a", "b"), joined=("b",), gone=("c",), reason="x", t=1.5)
    assert Generation.from_json(generation.to_json()) == generation


BAD_EVENTS = [
    b"\x00not json",  # what read_events hands over when an event is not JSON
    ["a", "list"],
    {"kind": "gone", "code": 0},  # no member: a finish of nobody must not end the decisions
    {"kind": "gone", "member": "n0.g9.9", "code": 0},  # no launcher named: only the member's own says gone
    {"kind": "gone", "member": "n0.g1.1", "code": -9, "node": 1},  # node 1's launcher about node 0's worker
    {"kind": "gone", "member": "n0.g1.1", "code": "-9", "node": 0},
    {"kind": "gone", "member": "n0.g1.1", "code": True, "node": 0},
    {"kind": "join", "member": "n7.g0.0", "node": 7},  # a launcher that never announced itself
    {"kind": "join", "member": "mallory", "node": 0},
    {"kind": "join", "member": {"x": 1}},
    {"kind": "leave", "member": "n0.g0.0\n"},
    {"kind": "failed", "member": "n0.g0.0", "gen": "1"},
    {"kind": "node", "node": 0, "workers": 5},  # node 0 again
    {"kind": "node", "node": -1, "workers": 1},
    {"kind": "node", "node": 2, "workers": 10**9},
    {"kind": "shutdown"},
    {},
]


def test_a_bad_event_is_skipped_with_its_reason_and_changes_nothing() -> None:
    coordinator = Coordinator()
    _started(coordinator, "n0.g0.0", "n0.g1.1", "n0.g2.2")
    first = coordinator.next_generation(0.0)
    assert first is not None
    before = repr(coordinator)

    skipped = coordinator.apply(BAD_EVENTS)

    assert len(skipped) == len(BAD_EVENTS) and all(isinstance(why, str) and why for why in skipped), skipped
    assert repr(coordinator) == before
    assert coordinator.next_generation(1.0) is None and not coordinator.done
    coordinator.apply([{"kind": "gone", "member": "n0.g1.1", "code": -9, "node": 0}])  # a real death still counts
    second = coordinator.next_generation(2.0)
    assert second is not None and second.members == ("n0.g0.0", "n0.g2.2")


def test_a_finish_counts_only_from_a_member_that_joined() -> None:
    coordinator = Coordinator()
    _started(coordinator, "n0.g0.0", "n0.g1.1")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "n0.g5.5", "code": 0, "node": 0}])
    assert not coordinator.done
    coordinator.apply([{"kind": "gone", "member": "n0.g0.0", "code": 0, "node": 0}])
    assert coordinator.done and coordinator.next_generation(1.0) is None
