"""A one-node `gpuwatch launch` worker: its store authenticates and its process group proves itself.

torch's `init_process_group` with `env://` connects to a TCPStore at MASTER_ADDR:MASTER_PORT that
answers anyone on the node, and gloo's listeners give a pair's socket to the first connection that
names it: another local user could read and write the workers' keys or sit in their group. So each
worker of a one-node launch starts here (`python -c` from gpuwatch.launcher.job_args), before the job:

* the `env://` rendezvous connects to the agent's store (gpuwatch.launcher.local_rendezvous hosts a
  gpuwatch.inplace.jobstore StoreServer on 127.0.0.1) and proves the launch's secret, read from the
  file in $GPUWATCH_WORKER_SECRET_FILE; a connection of another user is closed before a byte;
* `init_process_group` through `env://` (what an unmodified script calls) forms the default group
  with gpuwatch.inplace.groupproof: every rank proves the secret over the new group before it is
  used, and a group a stranger sits in is destroyed and formed again (one line and a count).

Then it runs the job's `[-m] SCRIPT ARGS` as `python` would (the job's exit is the process's).
"""

from __future__ import annotations

import datetime
import functools
import importlib
import inspect
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gpuwatch.inplace import subgroups
from gpuwatch.inplace.groupproof import form_group, proof_device
from gpuwatch.inplace.jobstore import JobStore
from gpuwatch.inplace.secret import read_secret
from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV

_CALLERS = ("torch.distributed.distributed_c10d", "torch.distributed", "torch.distributed.device_mesh")
_PREFIX = "default_pg"  # where torch's own init meets in its store: the first attempt's keys are torch's
_held: list[dist.Store] = []  # a Python store that only torch holds loses its methods (later groups use it)


def main(argv: list[str]) -> int:
    """Secure this worker's distributed plane when the launch gave it a secret, then run the job."""
    secret_file = os.environ.get(WORKER_SECRET_ENV)
    if secret_file:
        install(read_secret(secret_file))
    _run(argv)
    return 0


def install(secret: bytes) -> None:
    """Route `env://` through the authenticated store and make the default group prove itself."""
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers  # not the function
    handlers["env"] = functools.partial(_env_rendezvous, secret)
    original = c10d.init_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        a = given.arguments
        if a["store"] is not None or a["init_method"] not in (None, "env://") or a.get("_ranks"):
            return original(*args, **kwargs)  # the job chose its own store or method: as it asked
        timeout = a["timeout"] or c10d._get_default_timeout(a["backend"])
        store, rank, world = next(_env_rendezvous(secret, "env://", timeout, rank=a["rank"], world=a["world_size"]))
        options = {k: a[k] for k in ("group_name", "pg_options", "device_id") if a[k] not in (None, "")}
        form_group(
            a["backend"], store, _PREFIX, rank, world, timeout, secret, proof_device(a["backend"], a["device_id"]),
            "default", options=options,
        )  # fmt: skip
        return None

    for name in _CALLERS:  # the modules that hold the function under its own name (init_device_mesh's too)
        module = importlib.import_module(name)
        if getattr(module, "init_process_group", None) is original:
            module.init_process_group = init_process_group  # type: ignore[attr-defined]
    subgroups.install()  # and every group the script makes later proves itself too


def _env_rendezvous(
    secret: bytes, url: str, timeout: datetime.timedelta = c10d.default_pg_timeout, *, rank: int = -1,
    world: int = -1, **_: Any,
) -> Iterator[tuple[dist.Store, int, int]]:  # fmt: skip
    """torch's env:// handler, with the launch's authenticated store in place of a TCPStore client."""
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    rank = int(query.get("rank", rank if rank >= 0 else os.environ["RANK"]))
    world = int(query.get("world_size", world if world >= 0 else os.environ["WORLD_SIZE"]))
    store = JobStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), secret, timeout)
    _held.append(store)
    yield store, rank, world
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _run(argv: list[str]) -> None:
    """`python [-m] SCRIPT ARGS` in this process: the job runs as __main__; its SystemExit is ours."""
    if argv[0] in ("-m", "--module"):
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        script = os.path.abspath(argv[0])  # `python SCRIPT` makes __main__.__file__ absolute
        sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does
        runpy.run_path(script, run_name="__main__")
