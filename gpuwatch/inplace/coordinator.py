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
* Every event is checked before it counts (its kind, a member id of a launcher that announced
  itself, a `gone` only from the member's own launcher, numbers that are numbers): a bad one is
  skipped, its reason returned once, and changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.inplace.protocol import FAILED, GONE, JOIN, LEAVE, NODE, Generation

_MEMBER = re.compile(r"n(\d{1,6})\.[\w.-]{1,64}", re.ASCII)  # n<launcher's node>.<its own id>, e.g. n0.g2.5
_MAX_WORKERS = 4096


@dataclass
class Coordinator:
    """The host launcher's view of the job's membership."""

    expected_nodes: int = 1
    current: Generation | None = None
    nodes: dict[int, int] = field(default_factory=dict)  # launcher's node index -> workers it started
    up: dict[str, None] = field(default_factory=dict)  # joined, in order of arrival (a dict: O(1) lookups)
    leaving: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    failed: dict[int, set[str]] = field(default_factory=dict)
    _dirty: bool = field(default=True, repr=False)  # an event counted since the last next_generation
    _set_of: int = field(default=0, repr=False)
    _set: frozenset[str] = field(default=frozenset(), repr=False)

    def apply(self, events: Iterable[Any]) -> list[str]:
        """Fold events (as protocol.append_event wrote them) into the view; why each bad one was skipped."""
        skipped = []
        for event in events:
            why = self._bad(event)
            if why is not None:
                skipped.append(why)
                continue
            kind, member = event["kind"], str(event.get("member", ""))
            self._dirty = True
            if kind == NODE:
                self.nodes[int(event["node"])] = int(event["workers"])
            elif kind == JOIN:
                if member not in self.up and member not in self.gone:
                    self.up[member] = None
            elif kind == LEAVE:
                self.leaving.add(member)
            elif kind == GONE:  # a finish counts from a member that joined; any other exit is gone
                finished = event["code"] == 0 and member in self.up
                (self.finished if finished else self.gone).add(member)
                if member in self.up and not finished:
                    del self.up[member]
            elif kind == FAILED:
                self.failed.setdefault(int(event["gen"]), set()).add(member)
        return skipped

    def _bad(self, event: Any) -> str | None:
        """Why `event` must not count, or None when it may."""
        if not isinstance(event, dict):
            return f"not a JSON object: {str(event)[:80]}"
        kind = event.get("kind")
        if kind == NODE:
            node, workers = event.get("node"), event.get("workers")
            if not _count(node) or not _count(workers) or int(workers or 0) > _MAX_WORKERS:
                return f"node event with node {node!r}, workers {workers!r}"
            return f"node {node} announced itself twice" if node in self.nodes else None
        if kind not in (JOIN, LEAVE, GONE, FAILED):
            return f"unknown kind {str(kind)[:40]!r}"
        member = event.get("member")
        match = _MEMBER.fullmatch(member) if isinstance(member, str) else None
        if match is None:
            return f"{kind} event with member {str(member)[:40]!r}, not a worker's id"
        node = int(match.group(1))
        if node not in self.nodes:
            return f"{kind} {member}: no launcher {node} announced itself"
        said_by = event.get("node") if kind == GONE else event.get("node", node)  # a launcher names itself
        if said_by != node:
            return f"{kind} {member} from node {said_by!r}: only the member's own launcher may say that"
        if kind == GONE and not (_count(event.get("code"), low=-255) and event["code"] <= 255):
            return f"gone {member} with code {event.get('code')!r}"
        if kind == FAILED and not _count(event.get("gen"), low=1):
            return f"failed {member} in generation {event.get('gen')!r}"
        return None

    @property
    def done(self) -> bool:
        """A member finished: the job's work is done."""
        return bool(self.finished)

    def next_generation(self, now: float) -> Generation | None:
        """The generation to publish now, or None when the current one stands."""
        if self.finished or not self._dirty:
            return None  # nothing happened since the last look: the idle check costs nothing
        self._dirty = False
        if self.current is None:
            return self._first(now)
        current = self.current
        in_current = self._members_set()
        gone = tuple(m for m in current.members if m in self.gone)
        left = tuple(m for m in current.members if m in self.leaving and m not in self.gone)
        joined = tuple(m for m in self.up if m not in in_current and m not in self.leaving)
        if gone or left or joined:  # sets all the way: a change is O(N), never O(N^2)
            out = {*gone, *left}
            kept = [m for m in current.members if m not in out]
            members = (*kept, *joined)
            reasons = [
                f"{what} {', '.join(ms)}" for what, ms in (("gone", gone), ("left", left), ("joined", joined)) if ms
            ]
            return self._publish(members, joined, left, gone, "; ".join(reasons), now, fresh=not kept and bool(joined))
        failed = self.failed.get(current.number)
        if failed and all(m in failed for m in current.members if m not in self.gone):
            return self._publish(current.members, (), (), (), "re-formed after a failed collective", now)
        return None

    def _members_set(self) -> frozenset[str]:
        """The current generation's members as a set, made once per generation (the idle check is O(1))."""
        assert self.current is not None
        if self._set_of != self.current.number:
            self._set_of, self._set = self.current.number, frozenset(self.current.members)
        return self._set

    def _first(self, now: float) -> Generation | None:
        if len(self.nodes) < self.expected_nodes:
            return None
        expected = sum(self.nodes.values())
        accounted = len(self.up) + sum(1 for m in self.gone if m not in self.up)
        if accounted < expected or not self.up:
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


def _count(value: Any, low: int = 0) -> bool:
    """An int (not a bool) of at least `low`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
