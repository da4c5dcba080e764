"""The ranks of a job agree on what to restore, so every rank resumes from the same step.

Each rank can see only the slots on its own node, and a slot may be torn on one rank and whole on
another (they die at different instants), so the step a job restores is the newest one every rank
holds. Without torch.distributed initialized, or in a world of one, a rank decides alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def _group() -> Any:
    """torch.distributed when initialized with more than one rank, else None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist


def rank_and_world() -> tuple[int, int] | None:
    """(rank, world size) of the initialized process group, or None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def common_steps(local: Iterable[int]) -> list[int]:
    """The steps every rank holds, newest first (all ranks call it: a collective when there are several)."""
    mine = sorted(set(local))
    dist = _group()
    if dist is None:
        return sorted(mine, reverse=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    common = set(mine)
    for steps in gathered:
        common &= set(steps or ())
    return sorted(common, reverse=True)


def everyone(flag: bool) -> bool:
    """True when `flag` is true on every rank (a collective when there are several)."""
    dist = _group()
    if dist is None:
        return flag
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, bool(flag))
    return all(gathered)
