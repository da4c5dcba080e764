"""512 ranks on one job store: a membership change reaches every survivor within a second, and a job
where nothing changes asks the store nothing.

Each simulated rank is the rank-side code itself, as InPlaceJob holds it: two proved JobStore
connections, its `join` event, and a Membership (the long poll's thread, the counter meeting). The
store and the coordinator loop are the hosting launcher's (StoreServer and launcher.coordination).
Before, every rank's watcher asked `check` and `get` every 20 ms: 100 requests a
second per rank, 51,200 a second here, and the store saturated near 250 ranks.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from gpuwatch.inplace.jobstore import JobStore, StoreServer  # noqa: E402
from gpuwatch.inplace.membership import Membership  # noqa: E402
from gpuwatch.inplace.protocol import GONE, JOIN, NODE, append_event, job_prefix  # noqa: E402
from gpuwatch.launcher.coordination import coordinate  # noqa: E402

RANKS, PER_NODE = 512, 8
NODES = RANKS // PER_NODE
SECRET = os.urandom(32).hex().encode()
PREFIX = job_prefix("scale")


class Rank:
    """One simulated rank: its connections and its Membership."""

    def __init__(self, port: int, member: str, node: int) -> None:
        timeout = datetime.timedelta(seconds=60)
        self.member = member
        self.watch, self.ask = (JobStore("127.0.0.1", port, SECRET, timeout) for _ in range(2))
        append_event(dist.PrefixStore(PREFIX, self.ask), JOIN, member=member, node=node)
        self.membership = Membership(self.watch, self.ask, f"{PREFIX}/")

    def meet(self, number: int, members: int) -> None:
        assert self.membership.meet(number, members, 60.0, until_done=False), f"{self.member} did not meet"

    def kill(self) -> None:
        self.membership.close()
        self.ask.close()


@pytest.fixture
def job() -> Iterator[tuple[StoreServer, dist.Store, list[Rank]]]:
    server = StoreServer("127.0.0.1", 0, SECRET)
    store = dist.PrefixStore(PREFIX, server.data)
    stop = threading.Event()
    threading.Thread(target=coordinate, args=(store, NODES, stop, print), daemon=True).start()
    for node in range(NODES):
        append_event(store, NODE, node=node, workers=PER_NODE)
    members = [(f"n{i // PER_NODE}.g{i % PER_NODE}.{i}", i // PER_NODE) for i in range(RANKS)]
    with ThreadPoolExecutor(8) as pool:
        ranks = list(pool.map(lambda m: Rank(server.port, *m), members))
    try:
        yield server, store, ranks
    finally:
        stop.set()
        for rank in ranks:
            rank.kill()
        server.close()


def meet_all(ranks: list[Rank], number: int) -> float:
    """Every rank meets in generation `number` at once (a thread each: the meeting waits for all); seconds."""
    started = time.monotonic()
    threads = [threading.Thread(target=r.meet, args=(number, len(ranks))) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), f"generation {number}: not every rank met"
    return time.monotonic() - started


def seen_by_all(ranks: list[Rank], number: int, limit_s: float) -> float:
    """Seconds from now until every rank's Membership says generation `number` is the newest."""
    started = time.monotonic()
    for rank in ranks:
        assert rank.membership.wait_newer(number - 1, limit_s) >= number, f"{rank.member} never saw {number}"
    return time.monotonic() - started


@pytest.mark.slow
def test_a_change_reaches_512_ranks_within_a_second_and_an_idle_job_asks_the_store_nothing(
    job: tuple[StoreServer, dist.Store, list[Rank]],
) -> None:
    server, store, ranks = job
    seen_by_all(ranks, 1, 60.0)
    formed_s = meet_all(ranks, 1)

    time.sleep(0.5)  # the last meeting's answers are out
    before, started = server.requests, time.monotonic()
    time.sleep(3.0)
    idle_per_s = (server.requests - before) / (time.monotonic() - started)

    victim, survivors = ranks[-1], ranks[:-1]
    victim.kill()
    killed = time.monotonic()
    append_event(store, GONE, member=victim.member, code=-9, node=NODES - 1)  # as its launcher does
    seen_by_all(survivors, 2, 10.0)
    seen_s = time.monotonic() - killed
    met_s = meet_all(survivors, 2)
    print(
        f"\n{RANKS} ranks: met in generation 1 in {formed_s:.2f} s; idle: {idle_per_s:.1f} requests/s;"
        f" a rank killed: every survivor saw it in {seen_s:.3f} s, met in {met_s:.2f} s more"
    )
    assert idle_per_s <= NODES / 10, f"{idle_per_s:.0f} requests/s while nothing changes ({NODES} nodes)"
    assert seen_s <= 1.0, f"the change took {seen_s:.2f} s to reach every survivor"
    first = survivors[0].membership.generation(1).members
    assert survivors[0].membership.generation(2).members == tuple(m for m in first if m != victim.member)
