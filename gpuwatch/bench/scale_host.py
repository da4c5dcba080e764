"""The hosting launcher's side of the scale bench: the job's store and its coordinator, nothing else.

Run as a script (`python scale_host.py SECRET_FILE NODES`) it imports gpuwatch from sys.path as it
is given: the bench points PYTHONPATH at an older checkout for its "before" figures, so this file
uses only what every version has (StoreServer, Coordinator and the protocol's functions). It prints
`port N`, then serves until stdin closes; a line on stdin gets `requests N` back (-1 where the
version does not count them). Its CPU time is read from /proc by the bench.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

POLL_S = 0.005  # the launcher's coordinator loop reads the job's events this often


def coordinate(store: Any, expected_nodes: int, stop: threading.Event) -> None:
    """The hosting launcher's loop (gpuwatch.launcher.in_place): fold the events, publish each generation."""
    from gpuwatch.inplace.coordinator import Coordinator
    from gpuwatch.inplace.protocol import DONE, publish_generation, read_events

    coordinator = Coordinator(expected_nodes=expected_nodes)
    seen, said_done = 0, False
    while not stop.wait(POLL_S):
        events = read_events(store, seen)
        seen += len(events)
        coordinator.apply(events)
        generation = coordinator.next_generation(time.time())
        if generation is not None:
            publish_generation(store, generation)
        if coordinator.done and not said_done:
            store.set(DONE, "1")
            said_done = True


def main() -> None:
    import torch.distributed as dist

    from gpuwatch.inplace.jobstore import StoreServer
    from gpuwatch.inplace.protocol import job_prefix

    secret_file, nodes = sys.argv[1], int(sys.argv[2])
    server = StoreServer("127.0.0.1", 0, Path(secret_file).read_bytes().strip())
    store = dist.PrefixStore(job_prefix("scale"), server.data)
    stop = threading.Event()
    threading.Thread(target=coordinate, args=(store, nodes, stop), daemon=True).start()
    print(f"port {server.port}", flush=True)
    for _ in sys.stdin:
        print(f"requests {getattr(server, 'requests', -1)}", flush=True)
    stop.set()
    server.close()


if __name__ == "__main__":
    main()
