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

import datetime
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gpuwatch.errors import InPlaceError

log = logging.getLogger("gpuwatch.inplace")

ATTEMPTS = 5  # forms of one generation's group before the rank gives up (a stranger keeps winning the race)
_DIGEST = 32
_refused = 0  # groups destroyed for a failed proof in this process


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
    global _refused
    for attempt in range(ATTEMPTS):
        proofs = dist.PrefixStore(f"{prefix}/proof/{attempt}", store)
        meet = dist.PrefixStore(f"{prefix}.{attempt}" if attempt else prefix, store)
        try:
            dist.init_process_group(
                backend, store=meet, rank=rank, world_size=world, timeout=timeout, **(options or {})
            )
            problem = _prove(proofs, secret, rank, world, timeout, device)
        except Exception as exc:  # the group did not form, or a stranger's bytes broke the proof's exchange
            problem = f"no proof: {type(exc).__name__}: {_first_line(exc)[:300]}"
        proofs.set(f"verdict/{rank}", problem or "ok")
        verdicts = _verdicts(proofs, world, timeout)
        bad = {r: v for r, v in verdicts.items() if v != "ok"}
        if not bad:
            return attempt
        _refused += 1
        log.warning(
            "process group %s attempt %d of rank %d did not prove itself (%s): destroyed, formed again"
            " (%d refused in this process)",
            label, attempt, rank, "; ".join(f"rank {r}: {v}" for r, v in sorted(bad.items())), _refused,
        )  # fmt: skip
        _destroy()
    raise GroupProofError(f"process group {label}: no group proved itself in {ATTEMPTS} attempts")


def _prove(store: dist.Store, secret: bytes, rank: int, world: int, timeout: datetime.timedelta, device: Any) -> str:
    """'' when every rank's proof over the group is right; else what is wrong."""
    store.set(f"nonce/{rank}", os.urandom(_DIGEST).hex())
    keys = [f"nonce/{r}" for r in range(world)]
    store.wait(keys, timeout)
    nonces = b"".join(bytes.fromhex(store.get(k).decode()) for k in keys)
    mine = torch.tensor(list(_mac(secret, rank, world, nonces)), dtype=torch.uint8, device=device)
    gathered = [torch.zeros(_DIGEST, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine)
    got = [bytes(t.cpu().tolist()) for t in gathered]
    forged = [r for r in range(world) if not hmac.compare_digest(got[r], _mac(secret, r, world, nonces))]
    return f"forged or missing proof of rank {', '.join(map(str, forged))}" if forged else ""


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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
