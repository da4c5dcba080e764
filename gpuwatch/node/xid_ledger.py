"""Each GPU's XIDs: how many of each code, the kernel log's newest, and one fault seen by two sources kept as one.

NVML's event set and the kernel log both report an XID; the same code on the same GPU within DEDUPE_S is
one fault, and the pair keeps what either knew (the kernel log often has the pid, NVML not).

Locking: none of its own. Only the monitor calls it, always under the monitor's lock.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from gpuwatch.model import GpuError, GpuEvent

# An XID from NVML's event set and one from the kernel log, same GPU and code, this close in time: one fault.
DEDUPE_S = 5.0
KERNEL_XIDS_LISTED = 16  # per GPU, the newest kernel-log XIDs shown with their kernel time


class XidLedger:
    """Per GPU: the XID counter the alerts read, the kernel log's newest XIDs, and the XIDs taken lately."""

    def __init__(self, indices: Iterable[int]) -> None:
        indices = list(indices)
        self._counts: dict[int, Counter[int]] = {i: Counter() for i in indices}
        self._seen: dict[int, deque[list[Any]]] = {i: deque(maxlen=64) for i in indices}
        self._kernel: dict[int, deque[GpuEvent]] = {i: deque(maxlen=KERNEL_XIDS_LISTED) for i in indices}

    def duplicate(self, reading: GpuEvent | GpuError) -> bool:
        """True for an XID already taken from the other source (NVML events, kernel log); lists kernel XIDs."""
        if not isinstance(reading, GpuEvent) or reading.kind != "xid":
            return False
        if reading.source == "kmsg":
            self._kernel[reading.index].append(reading)
        seen = self._seen[reading.index]
        for entry in seen:  # each event pairs with at most one of the other source
            other: GpuEvent = entry[0]
            close = abs(other.t - reading.t) <= DEDUPE_S
            if not entry[1] and other.source != reading.source and other.xid == reading.xid and close:
                entry[1] = True
                entry[0] = dataclasses.replace(
                    other, pid=other.pid or reading.pid, detail=other.detail or reading.detail
                )
                return True
        seen.append([reading, False])
        return False

    def count(self, reading: GpuEvent, since: float) -> None:
        """Count an XID that happened at or after `since`.

        An XID the kernel log kept from before the window (boot, daemon down) is listed, not counted:
        the counter feeds alerts, and an old fault must raise none.
        """
        if reading.xid is not None and reading.t >= since:
            self._counts[reading.index][reading.xid] += 1

    def counts(self, index: int) -> tuple[tuple[int, int], ...]:
        """(code, count) of GPU `index`, by code."""
        return tuple(sorted(self._counts[index].items()))

    def kernel_listed(self, index: int) -> tuple[GpuEvent, ...]:
        """The newest XIDs the kernel log reported on GPU `index`, with their kernel time."""
        return tuple(self._kernel[index])

    def taken(self, index: int) -> tuple[GpuEvent, ...]:
        """The XIDs taken lately on GPU `index`, each merged with its twin from the other source."""
        return tuple([entry[0] for entry in self._seen[index]])
