"""The membership decisions of an in-place job: from the event log to the next generation.

Pure (no store, no clock of its own): the hosting launcher feeds it the events as it reads them
and asks for the next generation after each batch, so the rules are tested without processes.

* The first generation forms once every expected launcher has said how many workers it started
  and all of those are up (or gone); nobody holds state yet, so it is `fresh`.
* After that, a member that is gone (its process exited other than 0) or that asked to leave (its
  GPU is quarantined) is dropped at once; a worker that is up and in no generation yet joins.
  Survivors keep their order, so the lowest survivor, the state's source, stays rank 0.
* When every live member reported a failed collective in the newest generation and nobody left,
  the same members form a new generation (a fresh process group after, say, a timeout).
* An exit with code 0 is a member that finished: the job is ending, no new generation for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.inplace.protocol import FAILED, GONE, JOIN, LEAVE, NODE, Generation


@dataclass
class Coordinator:
    """The host launcher's view of the job's membership."""

    expected_nodes: int = 1
    current: Generation | None = None
    nodes: dict[int, int] = field(default_factory=dict)  # launcher's node index -> workers it started
    up: list[str] = field(default_factory=list)  # joined, in order of arrival
    leaving: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    failed: dict[int, set[str]] = field(default_factory=dict)

    def apply(self, events: Iterable[dict[str, Any]]) -> None:
        """Fold events (as protocol.append_event wrote them) into the view."""
        for event in events:
            kind, member = event.get("kind"), str(event.get("member", ""))
            if kind == NODE:
                self.nodes[int(event["node"])] = int(event["workers"])
            elif kind == JOIN:
                if member not in self.up and member not in self.gone:
                    self.up.append(member)
            elif kind == LEAVE:
                self.leaving.add(member)
            elif kind == GONE:
                (self.finished if event.get("code") == 0 else self.gone).add(member)
                if member in self.up and event.get("code") != 0:
                    self.up.remove(member)
            elif kind == FAILED:
                self.failed.setdefault(int(event["gen"]), set()).add(member)

    def next_generation(self, now: float) -> Generation | None:
        """The generation to publish now, or None when the current one stands."""
        if self.finished:
            return None
        if self.current is None:
            return self._first(now)
        current = self.current
        gone = tuple(m for m in current.members if m in self.gone)
        left = tuple(m for m in current.members if m in self.leaving and m not in self.gone)
        kept = [m for m in current.members if m not in gone and m not in left]
        joined = tuple(m for m in self.up if m not in current.members and m not in self.leaving)
        members = (*kept, *joined)
        if members != current.members:
            reasons = [
                f"{what} {', '.join(ms)}" for what, ms in (("gone", gone), ("left", left), ("joined", joined)) if ms
            ]
            return self._publish(members, joined, left, gone, "; ".join(reasons), now, fresh=not kept and bool(joined))
        live = set(current.members) - self.gone
        if live and live <= self.failed.get(current.number, set()):
            return self._publish(members, (), (), (), "re-formed after a failed collective", now)
        return None

    def _first(self, now: float) -> Generation | None:
        if len(self.nodes) < self.expected_nodes:
            return None
        expected = sum(self.nodes.values())
        accounted = [*self.up, *(m for m in self.gone if m not in self.up)]
        if len(accounted) < expected or not self.up:
            return None
        return self._publish(tuple(self.up), tuple(self.up), (), (), "first generation", now, fresh=True)

    def _publish(
        self,
        members: tuple[str, ...],
        joined: tuple[str, ...],
        left: tuple[str, ...],
        gone: tuple[str, ...],
        reason: str,
        now: float,
        *,
        fresh: bool = False,
    ) -> Generation:
        number = 1 if self.current is None else self.current.number + 1
        self.current = Generation(number, members, joined, left, gone, reason, now, fresh)
        return self.current
