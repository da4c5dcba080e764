"""One watcher of the job's store per node: the launcher's NodeRelay writes each generation for its ranks,
which read it from a file of their user's; the store holds a long poll per node, not per rank."""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from gpuwatch.inplace.jobstore import JobStore, StoreServer  # noqa: E402
from gpuwatch.inplace.membership import Membership  # noqa: E402
from gpuwatch.inplace.protocol import GONE, JOIN, NODE, append_event, job_prefix  # noqa: E402
from gpuwatch.inplace.relay import node_relay, read_relay  # noqa: E402
from gpuwatch.launcher.coordination import coordinate  # noqa: E402

NODES, PER_NODE = 8, 8
SECRET = os.urandom(32).hex().encode()
PREFIX = job_prefix("relay")


@pytest.mark.slow
def test_a_change_reaches_every_rank_through_its_node_and_costs_the_store_a_push_per_node() -> None:
    server = StoreServer("127.0.0.1", 0, SECRET)
    store = dist.PrefixStore(PREFIX, server.data)
    stop = threading.Event()
    threading.Thread(target=coordinate, args=(store, NODES, stop, print), daemon=True).start()
    relays = [node_relay(f"127.0.0.1:{server.port}", SECRET, PREFIX) for _ in range(NODES)]
    ranks: list[tuple[str, Membership, JobStore]] = []
    try:
        for node, relay in enumerate(relays):
            assert relay is not None
            append_event(store, NODE, node=node, workers=PER_NODE)
            for gpu in range(PER_NODE):
                member = f"n{node}.g{gpu}.{gpu}"
                watch, ask = (JobStore("127.0.0.1", server.port, SECRET, datetime.timedelta(seconds=30)) for _ in "ab")
                append_event(dist.PrefixStore(PREFIX, ask), JOIN, member=member, node=node)
                ranks.append((member, Membership(watch, ask, f"{PREFIX}/", relay=str(relay.path)), ask))
        everyone = len(ranks)
        for _, membership, _ in ranks:
            assert membership.wait_newer(0, 30) == 1
        meet_all([m for _, m, _ in ranks], 1, everyone)

        time.sleep(0.5)
        before = server.requests
        time.sleep(1.0)
        assert server.requests == before, "an idle job asked the store"

        (victim, membership, ask), survivors = ranks[-1], ranks[:-1]
        membership.close()
        ask.close()
        before, killed = server.requests, time.monotonic()
        append_event(store, GONE, member=victim, code=-9, node=NODES - 1)
        for _, m, _ in survivors:
            assert m.wait_newer(1, 5) == 2
        seen_s = time.monotonic() - killed
        meet_all([m for _, m, _ in survivors], 2, len(survivors))
        asked = server.requests - before
    finally:
        stop.set()
        for relay in relays:
            if relay is not None:
                relay.close()
        server.close()
    assert seen_s < 1.0, seen_s
    # a push per node (its relay's next long poll), the meeting's add and watch per rank, the launcher's event
    assert asked <= NODES + 2 * len(survivors) + 4, f"{asked} requests for one change of {everyone} ranks"


def meet_all(memberships: list[Membership], number: int, members: int) -> None:
    threads = [
        threading.Thread(target=m.meet, args=(number, members, 30.0), kwargs={"until_done": False}) for m in memberships
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_a_rank_reads_only_its_own_users_file_that_nobody_else_can_write(tmp_path: Path) -> None:
    path = tmp_path / "membership"
    path.write_text('{"gen": 3, "delta": null, "done": false}')
    path.chmod(0o600)
    assert read_relay(str(path)) == (3, None, False)
    path.chmod(0o666)
    assert read_relay(str(path)) is None
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    assert read_relay(str(link)) is None
