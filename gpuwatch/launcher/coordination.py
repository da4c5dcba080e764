"""The job's coordinator loop, as the hosting launcher runs it: read the events, publish each new generation.

One loop on one thread owns the Coordinator (gpuwatch.inplace.coordinator); it ends only when `stop`
is set. The launcher runs it for its job (launcher.in_place), and the tests run the same loop against
a store of their own, so what they prove of membership is what a job gets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from gpuwatch.inplace.coordinator import Coordinator
from gpuwatch.inplace.protocol import DONE, publish_generation, read_events

POLL_S = 0.005  # how often the job's events are read: a membership change waits at most this for its generation


def coordinate(store: dist.Store, expected_nodes: int, stop: threading.Event, echo: Callable[[str], None]) -> None:
    """Fold the job's events into generations until `stop` (`store` is the job's prefixed store).

    A bad event is said once and skipped (Coordinator.apply); any other error is said once per kind
    and the loop goes on (a thread that ends anyway stops the job: the launcher watches it).
    """
    coordinator = Coordinator(expected_nodes=expected_nodes)
    seen, said_done, errors = 0, False, set()
    while not stop.wait(POLL_S):
        try:
            events = read_events(store, seen)
            seen += len(events)  # first: an event that fails is never read again
            for why in coordinator.apply(events):
                echo(f"gpuwatch launch: in place: skipped a bad event: {why}")
            generation = coordinator.next_generation(time.time())
            if generation is not None:
                publish_generation(store, generation)
                echo(
                    f"gpuwatch launch: in place: generation {generation.number}, {len(generation.members)}"
                    f" rank(s) ({generation.reason})"
                )
            if coordinator.done and not said_done:
                store.set(DONE, "1")  # no generation comes any more: a late joiner ends instead of waiting
                said_done = True
        except Exception as exc:
            if type(exc) not in errors:
                errors.add(type(exc))
                echo(f"gpuwatch launch: in place: the coordinator goes on after {type(exc).__name__}: {exc}")
