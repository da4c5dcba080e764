"""The order of an interleaved run: alone, X, alone, Y, ..., alone, round after round.

Every condition sits between two alone segments (stats.py compares it with both), and the order of
the conditions turns by one each round, so none always follows the same neighbour (a monitor that
leaves something behind, a page cache warmed by the one before) and the drift over a round falls on
each condition in turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuwatch.bench.stats import ALONE


@dataclass(frozen=True)
class Segment:
    """One stretch of timed steps: the job alone (ALONE) or beside the condition `key`, in round `round`."""

    key: str
    seconds: float
    round: int


def interleave(
    keys: Sequence[str], rounds: int, seconds: float, longer: Mapping[str, float] | None = None
) -> list[Segment]:
    """alone, then each condition followed by alone, `rounds` times, the conditions' order turned by one a round.

    A condition in `longer` lasts that many seconds, and so does the alone segment after it.
    """
    if not keys or rounds < 1:
        raise ValueError("an interleaved run needs at least one condition and one round")
    segments = [Segment(ALONE, seconds, 0)]
    for number in range(rounds):
        shift = number % len(keys)
        for key in [*keys[shift:], *keys[:shift]]:
            length = (longer or {}).get(key, seconds)
            segments += [Segment(key, length, number), Segment(ALONE, length, number)]
    return segments


def round_seconds(seconds: float, overheads_s: Sequence[float]) -> float:
    """About how long one round takes: each condition and the alone segment after it, with what each costs
    besides its timed seconds (a start, the settles)."""
    return sum(2 * seconds + overhead for overhead in overheads_s)


def rounds_within(budget_s: float, round_s: float, least: int = 2) -> int:
    """As many rounds of `round_s` as fit in `budget_s`, and at least `least` (two give an interval, however wide)."""
    return max(least, int(budget_s // round_s)) if round_s > 0 else least
