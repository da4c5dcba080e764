"""How often to snapshot: the fewest steps between snapshots that keep their cost under a share of the step.

A snapshot costs what the training loop sees: the step intervals it was in flight for, less as many
plain steps (HostSnapshot measures it from its own calls, once a step). Every K steps, that is
cost / (K × step time) of the run; K is the smallest integer that keeps it at or under the share,
and not below the snapshot's drain (a snapshot due before the previous one is committed waits).
"""

from __future__ import annotations

TARGET_SHARE = 0.01
MAX_EVERY = 10_000
AUTO = "auto"


def choose_every(
    cost_s: float,
    step_s: float,
    *,
    share: float = TARGET_SHARE,
    max_every: int = MAX_EVERY,
    background_s: float = 0.0,
) -> int:
    """The cadence (steps between snapshots) that keeps `cost_s` per snapshot within `share` of a `step_s` step.

    Args:
        cost_s: what one snapshot costs the training loop (seconds).
        step_s: the step time without snapshots (seconds).
        share: the budget, e.g. 0.01 for 1 % of the step time.
        max_every: the largest cadence returned (a tiny step with a large state would ask for more).
        background_s: the snapshot's own time off the step (the drain, the checksums, the commit): a
            snapshot due before that time is up waits for the rest, so that wait counts at a short cadence.

    Raises:
        ValueError: share is not in (0, 1], or max_every is below 1.
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], not {share}")
    if max_every < 1:
        raise ValueError(f"max_every must be at least 1, not {max_every}")
    if cost_s <= 0 and background_s <= 0:
        return 1
    if step_s <= 0:
        return max_every
    for every in range(1, max_every + 1):
        if cost_s + max(0.0, background_s - every * step_s) <= share * every * step_s + 1e-12:
            return every
    return max_every


def parse_every(value: int | str) -> int | None:
    """`every` as given: a positive int, or "auto" (None: measured at the first snapshot).

    Raises:
        ValueError: neither a positive integer nor "auto" (one line naming the value).
    """
    if value == AUTO:
        return None
    if isinstance(value, str):
        if not value.isdigit():
            raise ValueError(f"snapshot cadence must be a positive integer or 'auto', not {value!r}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"snapshot cadence must be a positive integer or 'auto', not {value!r}")
    return value
