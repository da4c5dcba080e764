"""The bench's statistics: nearest-rank percentiles and latency summaries for every section, and the statistics
of the interference section's interleaved run: step summaries, each condition against the alone segments
either side.

A condition's segment is compared with the mean of the alone segments just before and just after it
(the plan puts one on each side), so a slow drift of the card (clocks, temperature, power capping)
cancels out to first order. Each such pair gives one ratio; the interval is Student's t over the
ratios of a condition's pairs (95 %, two-sided), so it widens honestly when the pairs disagree or are
few. The alone segments compared the same way with the alone segments two places away give the
placebo: what "no effect" looks like in this run. Two conditions of one run compare round by round
(`difference`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of already sorted values."""
    return sorted_values[max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))]


def summarize(values_s: Sequence[float], unit: str) -> dict[str, float]:
    """Mean, p50 and p99 of durations in seconds, in `unit` (us or ms), and how many there were."""
    scale = {"us": 1e6, "ms": 1e3, "s": 1.0}[unit]
    ordered = sorted(values_s)
    return {
        f"mean_{unit}": sum(ordered) / len(ordered) * scale,
        f"p50_{unit}": percentile(ordered, 0.50) * scale,
        f"p99_{unit}": percentile(ordered, 0.99) * scale,
        "n": len(ordered),
    }


ALONE = "alone"
STATS = ("p50", "mean")
# Student's t, 97.5th percentile, for 1..30 degrees of freedom (two-sided 95 %).
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_975(df: int) -> float:
    """The 97.5th percentile of Student's t with `df` degrees of freedom (beyond 30: within 0.1 % of it)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, not {df}")
    return _T_975[df - 1] if df <= len(_T_975) else 1.96 + 2.4 / df


@dataclass(frozen=True)
class Steps:
    """One segment's (or one condition's pooled) step times, in seconds."""

    n: int
    p50: float
    mean: float
    p99: float
    max: float

    def stat(self, name: str) -> float:
        value: float = getattr(self, name)
        return value

    def as_ms(self) -> dict[str, float]:
        return {"n": self.n, **{f"{k}_ms": getattr(self, k) * 1e3 for k in ("p50", "mean", "p99", "max")}}


def summarize_steps(values: Sequence[float]) -> Steps:
    """p50, mean, p99 (nearest rank) and max of step times; at least one is needed."""
    if not values:
        raise ValueError("no step was timed in this segment")
    ordered = sorted(values)
    return Steps(
        len(ordered), percentile(ordered, 0.5), sum(ordered) / len(ordered), percentile(ordered, 0.99), ordered[-1]
    )


@dataclass(frozen=True)
class Ratio:
    """A condition's step statistic over alone's: the mean of the per-pair ratios and its 95 % t interval."""

    mean: float
    low: float | None  # None with fewer than two pairs: no interval
    high: float | None
    pairs: int

    def as_pct(self) -> dict[str, float | int | None]:
        """As a cost in percent (+0.5 means steps 0.5 % slower than alone)."""

        def pct(value: float | None) -> float | None:
            return None if value is None else (value - 1.0) * 100.0

        return {"pct": pct(self.mean), "low_pct": pct(self.low), "high_pct": pct(self.high), "pairs": self.pairs}


def interval(ratios: Sequence[float]) -> Ratio:
    """Mean of `ratios` with its two-sided 95 % Student t interval (none for a single ratio)."""
    if not ratios:
        raise ValueError("no pair to compare")
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return Ratio(mean, None, None, 1)
    half = t_975(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return Ratio(mean, mean - half, mean + half, len(ratios))


def difference(ratios: Sequence[float], others: Sequence[float]) -> Ratio:
    """Round by round, one condition's ratio minus another's (each condition has one segment a round),
    with the t interval over the rounds: as a Ratio around 1, so `as_pct` reads in percentage points.

    Paired by round, the drift both share and the noise of the alone segments near both cancel more
    than in the difference of the two conditions' own intervals.
    """
    return interval([1.0 + a - b for a, b in zip(ratios, others, strict=False)])


def paired_ratios(segments: Sequence[tuple[str, Steps]], stat: str) -> dict[str, list[float]]:
    """Per condition, each of its segments' `stat` over the mean of the nearest alone segment on each side.

    Alone segments themselves are compared with the nearest other alone segment on each side, under
    ALONE: the placebo. A segment without an alone segment on both sides (the first and last alone
    ones) is left out: one side alone would not cancel a drift.
    """
    alone_at = [i for i, (key, _) in enumerate(segments) if key == ALONE]
    ratios: dict[str, list[float]] = {}
    for i, (key, steps) in enumerate(segments):
        before = [j for j in alone_at if j < i]
        after = [j for j in alone_at if j > i]
        if not before or not after:
            continue
        reference = (segments[before[-1]][1].stat(stat) + segments[after[0]][1].stat(stat)) / 2
        ratios.setdefault(key, []).append(steps.stat(stat) / reference)
    return ratios


def pooled(segments: Sequence[tuple[str, Sequence[float]]]) -> dict[str, Steps]:
    """Every condition's step times over all its segments together."""
    steps: dict[str, list[float]] = {}
    for key, values in segments:
        steps.setdefault(key, []).extend(values)
    return {key: summarize_steps(values) for key, values in steps.items()}
