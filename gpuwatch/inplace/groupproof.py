"""Every new process group proves itself before it carries state.

gloo's and NCCL's data connections are not authenticated: gloo's listener gives a pair's socket to
the first connection that names its sequence number, so another local user who connects first
sits in the group in a peer's place. So a group formed for the job is used only once every rank has
proved, over the group itself, that it holds the job's secret:

1. each rank writes a fresh random nonce to the job's authenticated store (gpuwatch.inplace.jobstore);
2. each rank sends HMAC-SHA256(secret, rank, world, every rank's nonce) in one all-gather over the
   new group, and checks every other rank's against its own computation;
3. each rank writes its verdict to the store and reads everyone's: the group is used only when all
   are good. A forged, missing or unreadable proof anywhere destroys the group on every rank, which
   then forms it again under a new store prefix (one line and a count each time), up to ATTEMPTS.

A stranger in a pair's place cannot compute a proof (no secret) nor replay one (fresh nonces, and
the rank is in the MAC); the verdicts travel through the authenticated store, so she cannot forge
agreement either. This proves who holds each connection when the group forms; later traffic is not
signed (docs/security.md says what that leaves).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gpuwatch.errors import InPlaceError

log = logging.getLogger("gpuwatch.inplace")

ATTEMPTS = 5  # forms of one generation's group before the rank gives up (a stranger keeps winning the race)
_DIGEST = 32
_refused = 0  # groups destroyed for a failed proof in this process
_proved: tuple[dist.Store, bytes] | None = None  # the default group's store and secret, once it proved itself
_exit_hook = False  # whether _destroy_if_proved runs at exit (registered once a process)
G = TypeVar("G")


class GroupProofError(InPlaceError, RuntimeError):
    """No group of the generation proved itself within ATTEMPTS (its text names the process group)."""


def refused() -> int:
    """How many groups this process destroyed because a proof failed."""
    return _refused


def form_group(
    backend: str,
    store: dist.Store,
    prefix: str,
    rank: int,
    world: int,
    timeout: datetime.timedelta,
    secret: bytes,
    device: torch.device,
    label: str,
    options: Mapping[str, Any] | None = None,
) -> int:
    """Initialise the default process group and make it prove itself; the attempt that held (0 first).

    Args:
        store: the job's authenticated store; attempt 0's group meets under `prefix`, attempt N's under
            `prefix.N`, and the nonces and verdicts go under `prefix/proof`.
        label: what the log line calls the group (its generation).
        options: more of init_process_group's arguments (group_name, pg_options, device_id).

    Raises:
        GroupProofError: no attempt's group proved itself (or a rank's verdict never came).
    """
    global _proved

    def form(attempt: int) -> None:
        meet = dist.PrefixStore(f"{prefix}.{attempt}" if attempt else prefix, store)
        dist.init_process_group(backend, store=meet, rank=rank, world_size=world, timeout=timeout, **(options or {}))

    attempt, _ = until_proved(
        form, lambda attempt: dist.PrefixStore(f"{prefix}/proof/{attempt}", store), lambda _: _destroy(),
        secret, rank, world, timeout, device, label,
    )  # fmt: skip
    _proved = (c10d._world.pg_map[c10d._get_default_group()][1], secret)  # for later groups (subgroups.py)
    _destroy_at_exit()
    return attempt


def until_proved(
    form: Callable[[int], G],
    proofs_of: Callable[[int], dist.Store],
    destroy: Callable[[G | None], None],
    secret: bytes,
    rank: int,
    world: int,
    timeout: datetime.timedelta,
    device: torch.device,
    label: str,
    gather: Callable[[G, dist.Store, list[torch.Tensor], torch.Tensor], None] | None = None,
) -> tuple[int, G]:
    """Form a group until one proves itself: (the attempt that held, what `form` returned for it).

    Args:
        form: makes attempt N's group on this rank (its handle; None for the default group).
        proofs_of: attempt N's store for the nonces and verdicts (the authenticated store, a fresh prefix).
        destroy: takes down a refused attempt's group (its handle, None when `form` raised).
        gather: the proof's all-gather over the group (default: a blocking dist.all_gather on the handle).

    Raises:
        GroupProofError: no attempt's group proved itself (or a rank's verdict never came).
    """
    global _refused
    for attempt in range(ATTEMPTS):
        proofs = proofs_of(attempt)
        group: G | None = None
        try:
            group = form(attempt)
            exchange = functools.partial(gather, group, proofs) if gather else functools.partial(_gather, group)
            problem = _prove(proofs, secret, rank, world, timeout, device, exchange)
        except Exception as exc:  # the group did not form, or a stranger's bytes broke the proof's exchange
            problem = f"no proof: {type(exc).__name__}: {_first_line(exc)[:300]}"
        proofs.set(f"verdict/{rank}", problem or "ok")
        verdicts = _verdicts(proofs, world, timeout)
        bad = {r: v for r, v in verdicts.items() if v != "ok"}
        if not bad:
            return attempt, group  # type: ignore[return-value]  # a good verdict means form() returned
        _refused += 1
        log.warning(
            "process group %s attempt %d of rank %d did not prove itself (%s): destroyed, formed again"
            " (%d refused in this process)",
            label, attempt, rank, "; ".join(f"rank {r}: {v}" for r, v in sorted(bad.items())), _refused,
        )  # fmt: skip
        destroy(group)
    raise GroupProofError(f"process group {label}: no group proved itself in {ATTEMPTS} attempts")


def proved() -> tuple[dist.Store, bytes] | None:
    """(the default group's store, the secret) when the current default group proved itself, else None."""
    if _proved is None or not dist.is_initialized():
        return None
    held = c10d._world.pg_map.get(c10d._get_default_group())
    return _proved if held is not None and held[1] is _proved[0] else None


def proof_device(backend: str | None, device_id: Any) -> torch.device:
    """Where a proof's tensors live: the GPU for an NCCL-only group, else the CPU (gloo)."""
    name = str(backend or "").lower()
    if "nccl" not in name or "gloo" in name:
        return torch.device("cpu")
    if isinstance(device_id, torch.device):
        return device_id
    return torch.device("cuda", device_id if isinstance(device_id, int) else int(os.environ.get("LOCAL_RANK", "0")))


def _prove(
    store: dist.Store, secret: bytes, rank: int, world: int, timeout: datetime.timedelta, device: Any,
    gather: Callable[[list[torch.Tensor], torch.Tensor], None],
) -> str:  # fmt: skip
    """'' when every rank's proof over the group is right; else what is wrong."""
    store.set(f"nonce/{rank}", os.urandom(_DIGEST).hex())
    keys = [f"nonce/{r}" for r in range(world)]
    store.wait(keys, timeout)
    nonces = b"".join(bytes.fromhex(store.get(k).decode()) for k in keys)
    mine = torch.tensor(list(_mac(secret, rank, world, nonces)), dtype=torch.uint8, device=device)
    gathered = [torch.zeros(_DIGEST, dtype=torch.uint8, device=device) for _ in range(world)]
    gather(gathered, mine)
    got = [bytes(t.cpu().tolist()) for t in gathered]
    forged = [r for r in range(world) if not hmac.compare_digest(got[r], _mac(secret, r, world, nonces))]
    return f"forged or missing proof of rank {', '.join(map(str, forged))}" if forged else ""


def _gather(group: Any, gathered: list[torch.Tensor], mine: torch.Tensor) -> None:
    dist.all_gather(gathered, mine, group=group)


def _verdicts(store: dist.Store, world: int, timeout: datetime.timedelta) -> dict[int, str]:
    """Every rank's verdict on this attempt (from the authenticated store); a missing one is a failure."""
    deadline = time.monotonic() + 3 * timeout.total_seconds()  # a peer's attempt: init, nonces, all-gather
    keys = [f"verdict/{r}" for r in range(world)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([f"verdict/{r}"])]
            raise GroupProofError(f"process group proof: no verdict from rank {', '.join(map(str, missing))}")
        time.sleep(0.01)
    return {r: store.get(k).decode(errors="replace")[:200] for r, k in enumerate(keys)}


def _mac(secret: bytes, rank: int, world: int, nonces: bytes) -> bytes:
    return hmac.new(secret, b"gpuwatch-group|%d|%d|" % (rank, world) + nonces, hashlib.sha256).digest()


def _destroy() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group a stranger broke may not shut down cleanly
            log.debug("destroying a refused group: %s", exc)
    else:  # init failed half way and counted its group: the next one must get the same name on every rank
        dist.distributed_c10d._world.group_count = 0


def _destroy_at_exit() -> None:
    """Take the proved group down when the interpreter exits, unless the job did.

    A process that exits with a gloo group over the job's store still alive is now and then killed by
    SIGABRT while the interpreter tears the group down ("terminate called without an active
    exception": 5 of 220 exits on this project's CI machine, none of 180 that destroyed it first); the
    launcher would count that exit as a crash.
    """
    global _exit_hook
    if not _exit_hook:
        atexit.register(_destroy_if_proved)
        _exit_hook = True


def _destroy_if_proved() -> None:
    if proved() is not None:
        _destroy()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
