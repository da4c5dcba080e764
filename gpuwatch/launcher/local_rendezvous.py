"""torchrun for a one-node `gpuwatch launch`, with a rendezvous that keeps nothing anyone can plant.

torchrun's `c10d` rendezvous keeps its state pickled in a TCPStore that listens on every interface
and answers anyone: another local user who writes a pickle there runs code as the job's user when
the agent reads the state back. One node has no peer agent to meet, so its rendezvous needs no
shared state at all: the `gpuwatch-local` backend registered here (through torch's rendezvous
handler registry) is the one node's rank 0 of 1 at once, keeps no state, unpickles nothing, and
hosts the workers' store on 127.0.0.1 only. That store is not torch's TCPStore (which answers every
local user) but gpuwatch.inplace.jobstore's StoreServer: it closes another user's connection before a
byte and serves only clients that prove the launch's secret (the file named by
$GPUWATCH_WORKER_SECRET_FILE); the workers connect to it through gpuwatch.launcher.worker_store.

Run as `python -m gpuwatch.launcher.local_rendezvous TORCHRUN-ARGS...`: torchrun itself, with the
backend registered; every other backend works as under torchrun.
"""

from __future__ import annotations

import os
import sys

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from gpuwatch.inplace.jobstore import StoreServer
from gpuwatch.inplace.secret import read_secret
from gpuwatch.launcher.job_args import LOCAL_RENDEZVOUS
from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV

BACKEND = LOCAL_RENDEZVOUS
_HOST = "127.0.0.1"


class LocalRendezvous(RendezvousHandler):
    """The rendezvous of a job on one node: this agent alone, the workers' store on loopback."""

    def __init__(self, run_id: str, secret: bytes) -> None:
        self._run_id = run_id
        self._secret = secret
        self._server: StoreServer | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this store (MASTER_ADDR/PORT: 127.0.0.1 and its port)

    def next_rendezvous(self) -> RendezvousInfo:
        if self._server is None:
            self._server = StoreServer(_HOST, 0, self._secret)  # loopback only; the secret's holders only
        store: Store = PrefixStore(self._run_id, self._server.data)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(_HOST, self._server.port))

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
        if self._server is not None:
            self._server.close()
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous is for one node (--nnodes 1), not {params.max_nodes}")
    secret_file = os.environ.get(WORKER_SECRET_ENV)
    if not secret_file:
        raise ValueError(f"the {BACKEND} rendezvous needs the launch's secret file in ${WORKER_SECRET_ENV}")
    return LocalRendezvous(params.run_id, read_secret(secret_file))


def register() -> None:
    """Make `--rdzv-backend gpuwatch-local` known to torchrun in this process."""
    rendezvous_handler_registry.register(BACKEND, _create)


def main() -> None:
    from torch.distributed.run import main as torchrun

    register()
    torchrun(sys.argv[1:])


if __name__ == "__main__":
    main()
