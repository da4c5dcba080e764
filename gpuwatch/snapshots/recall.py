"""Which host snapshot a relaunch restores: the newest step every rank holds, read and verified here.

`HostSnapshot.restore` calls `recall` on every rank (the agreement is collective, agree.py); the
reading and checking is restore.py's. Locking: none; it runs on the calling (training) thread and
keeps no state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.snapshots.agree import common_steps, everyone
from gpuwatch.snapshots.prefetch import Prefetch
from gpuwatch.snapshots.restore import Candidate, candidates, map_state, on_cuda, read_state, read_to_device

log = logging.getLogger("gpuwatch.snapshots")


@dataclass(frozen=True)
class Recalled:
    """The state of the step every rank restores, where it was read, and the own slot it maps (else None)."""

    step: int
    state: Any
    where: str
    mapped_slot: int | None


def recall(
    dir_fd: int | None,
    directory: Path,
    *,
    rank: int,
    world_size: int,
    replicated: bool,
    at_least: int | None,
    device: Any,
    prefetched: Prefetch | None = None,
) -> Recalled | None:
    """The newest step (at least `at_least`) whose snapshot every rank read and verified; None if there is none.

    Collective when there are several ranks: each calls it, also one with no directory (`dir_fd` None).
    `prefetched`: a read already under way onto `device` (prefetch.py), taken for the commit it holds.
    """
    found = [] if dir_fd is None else candidates(dir_fd, rank=rank, world_size=world_size, replicated=replicated)
    by_step: dict[int, list[Candidate]] = {}
    for candidate in found:
        if at_least is None or candidate.header.step >= at_least:
            by_step.setdefault(candidate.header.step, []).append(candidate)
    for step in common_steps(by_step):
        state, where, mapped = _read_one(dir_fd, directory, rank, by_step.get(step, []), device, prefetched)
        if everyone(state is not None):
            return Recalled(step, state, where, mapped.slot if mapped is not None else None)
    return None


def _read_one(
    dir_fd: int | None, directory: Path, rank: int, options: list[Candidate], device: Any, prefetched: Prefetch | None
) -> tuple[Any, str, Candidate | None]:
    """The state of the first option that verifies; where it was; the own slot it is mapped from (else None)."""
    on_gpu = on_cuda(device)
    for candidate in options:
        assert dir_fd is not None
        own = candidate.rank == rank and not on_gpu
        if on_gpu:
            taken = prefetched.take(candidate) if prefetched is not None else None  # another commit: dropped first
            state, reason = taken if taken is not None else read_to_device(dir_fd, candidate, device)
        else:
            state, reason = map_state(dir_fd, candidate) if own else read_state(dir_fd, candidate)
        if state is not None:
            return state, str(directory / candidate.name), candidate if own else None
        log.warning("host snapshot %s (step %d) not used: %s", candidate.name, candidate.header.step, reason)
    return None, "", None
