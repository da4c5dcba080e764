"""The membership rules, fed events as the launchers and ranks write them (no store, no processes)."""

from __future__ import annotations

from gpuwatch.inplace.coordinator import Coordinator
from gpuwatch.inplace.protocol import Generation


def _started(coordinator: Coordinator, *members: str, node: int = 0) -> None:
    coordinator.apply([{"kind": "node", "node": node, "workers": len(members)}])
    coordinator.apply({"kind": "join", "member": m, "node": node} for m in members)


def test_the_first_generation_waits_for_every_launcher_and_its_workers() -> None:
    coordinator = Coordinator(expected_nodes=2)
    _started(coordinator, "a0", "a1", node=0)
    assert coordinator.next_generation(1.0) is None  # node 1 has not said how many it started
    coordinator.apply([{"kind": "node", "node": 1, "workers": 2}, {"kind": "join", "member": "b0", "node": 1}])
    assert coordinator.next_generation(2.0) is None  # b1 is not up yet
    coordinator.apply([{"kind": "join", "member": "b1", "node": 1}])
    first = coordinator.next_generation(3.0)
    assert first is not None and (first.number, first.members, first.fresh) == (1, ("a0", "a1", "b0", "b1"), True)
    assert coordinator.next_generation(4.0) is None


def test_a_worker_that_died_before_joining_does_not_hold_the_first_generation() -> None:
    coordinator = Coordinator()
    coordinator.apply([{"kind": "node", "node": 0, "workers": 2}, {"kind": "join", "member": "a0"}])
    coordinator.apply([{"kind": "gone", "member": "a1", "code": -9}])
    first = coordinator.next_generation(1.0)
    assert first is not None and first.members == ("a0",)


def test_gone_and_leaving_members_drop_out_at_once_survivors_keep_their_order_joiners_come_last() -> None:
    coordinator = Coordinator()
    _started(coordinator, "m0", "m1", "m2")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "m0", "code": -9}])
    second = coordinator.next_generation(1.0)
    assert second == Generation(2, ("m1", "m2"), gone=("m0",), reason="gone m0", t=1.0)
    coordinator.apply([{"kind": "leave", "member": "m2"}, {"kind": "join", "member": "r0"}])
    third = coordinator.next_generation(2.0)
    assert third is not None and (third.members, third.left, third.joined) == (("m1", "r0"), ("m2",), ("r0",))
    assert not third.fresh  # m1 holds the state: the joiner gets it from m1
    coordinator.apply([{"kind": "gone", "member": "m2", "code": 75}])  # the leaver's exit changes nothing more
    assert coordinator.next_generation(3.0) is None


def test_when_every_live_member_failed_the_same_members_form_a_new_group() -> None:
    coordinator = Coordinator()
    _started(coordinator, "m0", "m1", "m2")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "failed", "member": "m0", "gen": 1}, {"kind": "failed", "member": "m1", "gen": 1}])
    assert coordinator.next_generation(1.0) is None  # m2 has not failed: it may be the one that hangs
    coordinator.apply([{"kind": "failed", "member": "m2", "gen": 1}])
    again = coordinator.next_generation(2.0)
    assert again is not None and (again.number, again.members) == (2, ("m0", "m1", "m2"))


def test_no_survivor_is_an_empty_generation_and_the_next_joiners_start_fresh() -> None:
    coordinator = Coordinator()
    _started(coordinator, "m0")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "m0", "code": -9}])
    empty = coordinator.next_generation(1.0)
    assert empty is not None and empty.members == ()
    coordinator.apply([{"kind": "join", "member": "r0"}])
    fresh = coordinator.next_generation(2.0)
    assert fresh is not None and fresh.members == ("r0",) and fresh.fresh  # rank 0 loads the checkpoint


def test_a_member_that_finished_ends_the_decisions() -> None:
    coordinator = Coordinator()
    _started(coordinator, "m0", "m1")
    coordinator.next_generation(0.0)
    coordinator.apply([{"kind": "gone", "member": "m0", "code": 0}])
    assert coordinator.next_generation(1.0) is None


def test_a_generation_round_trips_through_json() -> None:
    generation = Generation(3, ("a", "b"), joined=("b",), gone=("c",), reason="x", t=1.5)
    assert Generation.from_json(generation.to_json()) == generation
