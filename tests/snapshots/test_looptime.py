"""The loop's own step intervals, and what snapshots cost its wall time (looptime.py)."""

from __future__ import annotations

import pytest

from gpuwatch.snapshots import looptime
from gpuwatch.snapshots.looptime import LoopTime


def test_the_share_is_the_recent_steps_mean_against_their_plain_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(looptime, "WINDOW_STEPS", 100)
    clock = LoopTime()
    for _ in range(200):  # an earlier cadence: every other step in flight, 50 % slower; it leaves the window
        clock.record(0.010, in_flight=False)
        clock.record(0.015, in_flight=True)
    for k in range(100):  # now: one step in 10 in flight, 20 % slower; one plain step in 10 a long one
        clock.record(0.012 if k % 10 == 0 else 0.050 if k % 10 == 5 else 0.010, in_flight=k % 10 == 0)
    assert clock.wall_share() is None  # no snapshot measured yet
    cost = clock.snapshot_done([0.012] * 10, host_s=0.001, drain_s=0.005)
    plain_mean = (8 * 0.010 + 0.050) / 9
    mean = (10 * 0.012 + 80 * 0.010 + 10 * 0.050) / 100
    assert clock.plain_step() == pytest.approx(plain_mean)
    assert clock.wall_share() == pytest.approx(mean / plain_mean - 1)
    assert cost == pytest.approx(10 * (0.012 - 0.010))  # against the typical (median) plain step
    assert clock.median_plain_step(recent=3) == pytest.approx(0.010)


def test_the_loss_bound_is_k_plus_a_drain_or_two_drains_where_k_is_under_one() -> None:
    """Under the drain's floor a staged snapshot starts at the previous commit: they land once a drain, and a death
    loses that plus the drain in flight. With every step in flight (no plain step) the steps' mean sizes the drain."""
    from gpuwatch.snapshots.pacing import Pacing

    for every, plain, expected in ((8, True, 8 + 6), (4, True, 6 + 6), (4, False, 6 + 6)):
        pacing = Pacing(every, share=0.01, max_every=10_000)
        for _ in range(20):
            pacing.time.record(0.1, in_flight=not plain)
        assert pacing.loss_bound() is None  # no drain measured yet
        pacing.time.snapshot_done([0.1] * 6, host_s=0.0, drain_s=0.55)
        assert pacing.drain_steps() == 6 and pacing.loss_bound() == expected, (every, plain)
