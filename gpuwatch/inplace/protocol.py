"""What the launchers and the ranks of an in-place job say to each other, through the job's store.

The store (gpuwatch.inplace.jobstore: only clients that prove the job's secret reach it) is hosted
by a launcher (`gpuwatch launch --in-place`), never by a rank, so any rank may die without taking
the membership with it. Everything lives under one prefix per job:

* `events` (a counter, `store.add`) and `event/<i>`: an append-only log of what happened, JSON
  objects with a `kind`: `node` (a launcher and how many workers it started), `join` (a worker is
  up and waits for a generation that has it), `leave` (a worker's GPU is quarantined), `gone` (a
  worker's process exited, with its code, written by its launcher at once), `failed` (a worker's
  collective failed in generation `gen`).
* `gen` (the newest generation's number) and `gen/<g>`: the generation's record, written before
  `gen` moves, so a reader of `gen` always finds it; `gen/delta`: the newest generation without its
  member list (a rank that holds the one before makes the list itself: survivors in order, then
  the joiners), so a change moves a few hundred bytes to each rank, not the whole membership.
* `done`: a member finished (exited 0): the job's work is done, no generation comes any more, so a
  worker still waiting to join ends with 0 instead of holding the job open.
* `ready/<g>`: a counter: how many members reached generation g's rendezvous (each adds 1 once).
* `pg/<g>/`: the prefix under which generation g's process group exchanges its addresses.

stdlib only: the launcher and the trainer side both import it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

STORE_ENV = "GPUWATCH_INPLACE_STORE"  # host:port of the job's store
MEMBER_ENV = "GPUWATCH_INPLACE_MEMBER"  # this worker's member id, unique for the job's life
NODE_ENV = "GPUWATCH_INPLACE_NODE"  # the index of the launcher that started the worker
JOB_ENV = "GPUWATCH_JOB_ID"

JOIN, LEAVE, GONE, FAILED, NODE = "join", "leave", "gone", "failed", "node"
DONE = "done"  # the key a hosting launcher sets once a member finished
GEN, DELTA = "gen", "gen/delta"


class Store(Protocol):
    """The part of torch.distributed.Store used here (HashStore, JobStore and PrefixStore have it)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, value: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...


def job_prefix(job_id: str) -> str:
    """The store prefix of one job's keys."""
    return f"gpuwatch-inplace/{job_id}"


@dataclass(frozen=True)
class Generation:
    """One membership of the job: the ranks are the members' positions, survivors first, in their old order."""

    number: int
    members: tuple[str, ...]
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    reason: str = ""
    t: float = 0.0
    fresh: bool = field(default=False)  # no member holds state: they load (checkpoint) or start anew

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> Generation:
        body = json.loads(data)
        for name in ("members", "joined", "left", "gone"):
            body[name] = tuple(body.get(name, ()))
        return cls(**body)


def append_event(store: Store, kind: str, **fields: Any) -> int:
    """Append one event to the job's log; its index."""
    index = store.add("events", 1) - 1
    store.set(f"event/{index}", json.dumps({"kind": kind, **fields}))
    return index


def read_events(store: Store, start: int) -> list[Any]:
    """The events from index `start` on that are written (an index taken but not yet set ends the read).

    Each is what its JSON says, or the raw bytes when it is not JSON: the coordinator judges them.
    """
    count = store.add("events", 0)
    events: list[Any] = []
    for index in range(start, count):
        key = f"event/{index}"
        if not store.check([key]):
            break
        raw = store.get(key)
        try:
            events.append(json.loads(raw))
        except ValueError:
            events.append(bytes(raw))
    return events


def latest_generation(store: Store) -> int:
    """The newest generation's number; 0 before the first."""
    if not store.check(["gen"]):
        return 0
    return int(store.get("gen"))


def read_generation(store: Store, number: int) -> Generation:
    return Generation.from_json(store.get(f"gen/{number}"))


def publish_generation(store: Store, generation: Generation) -> None:
    """The record and its delta first, then the counter: whoever reads `gen` finds its record."""
    store.set(f"gen/{generation.number}", generation.to_json())
    store.set(DELTA, delta_json(generation))
    store.set(GEN, str(generation.number))


def delta_json(generation: Generation) -> str:
    """The generation as a change: its record without the member list (see the module docstring)."""
    body = asdict(generation)
    body["members"] = None
    return json.dumps(body)


def from_delta(data: bytes | str, previous: Generation | None) -> Generation | None:
    """The generation a delta describes, given the one before it (None when that is not the one before).

    A fresh generation's members are its joiners; any other keeps the survivors in order, joiners last.
    """
    body = json.loads(data)
    fields = {name: tuple(body.get(name) or ()) for name in ("joined", "left", "gone")}
    if body.get("fresh"):
        members = fields["joined"]
    elif previous is not None and previous.number == body["number"] - 1:
        out = {*fields["left"], *fields["gone"]}
        members = (*(m for m in previous.members if m not in out), *fields["joined"])
    else:
        return None
    return Generation(
        body["number"], members, reason=body.get("reason", ""), t=body.get("t", 0.0), fresh=bool(body.get("fresh")),
        **fields,
    )  # fmt: skip
