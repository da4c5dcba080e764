"""torchrun for a one-node `gpuwatch launch`, with a rendezvous that keeps nothing anyone can plant.

torchrun's `c10d` rendezvous keeps its state pickled in a TCPStore that listens on every interface
and answers anyone: another local user who writes a pickle there runs code as the job's user when
the agent reads the state back. One node has no peer agent to meet, so its rendezvous needs no
shared state at all: the `gpuwatch-local` backend registered here (through torch's rendezvous
handler registry) is the one node's rank 0 of 1 at once, keeps no state, unpickles nothing, and
hosts the workers' store on 127.0.0.1 only (a listening socket bound there, handed to TCPStore).

Run as `python -m gpuwatch.launcher.local_rendezvous TORCHRUN-ARGS...`: torchrun itself, with the
backend registered; every other backend works as under torchrun.
"""

from __future__ import annotations

import datetime
import socket
import sys

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from gpuwatch.launcher.job_args import LOCAL_RENDEZVOUS

BACKEND = LOCAL_RENDEZVOUS
_HOST = "127.0.0.1"


class LocalRendezvous(RendezvousHandler):
    """The rendezvous of a job on one node: this agent alone, the workers' store on loopback."""

    def __init__(self, run_id: str, timeout: datetime.timedelta) -> None:
        self._run_id = run_id
        self._timeout = timeout
        self._listener: socket.socket | None = None
        self._store: TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this store (MASTER_ADDR/PORT: 127.0.0.1 and its port)

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((_HOST, 0))  # never 0.0.0.0: TCPStore binds every interface when it binds itself
            listener.listen(4096)
            self._listener = listener
            port = listener.getsockname()[1]
            self._store = TCPStore(
                _HOST, port, is_master=True, master_listen_fd=listener.fileno(),
                wait_for_workers=False, timeout=self._timeout,
            )  # fmt: skip
        store: Store = PrefixStore(self._run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(_HOST, self._store.port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody else ever waits to join

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous is for one node (--nnodes 1), not {params.max_nodes}")
    timeout = datetime.timedelta(seconds=params.get_as_int("timeout", 900) or 900)
    return LocalRendezvous(params.run_id, timeout)


def register() -> None:
    """Make `--rdzv-backend gpuwatch-local` known to torchrun in this process."""
    rendezvous_handler_registry.register(BACKEND, _create)


def main() -> None:
    from torch.distributed.run import main as torchrun

    register()
    torchrun(sys.argv[1:])


if __name__ == "__main__":
    main()
