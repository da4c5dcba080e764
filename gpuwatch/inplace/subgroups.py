"""Every group a job makes after its default group proves itself too (new_group, new_subgroups, a mesh's).

A later group's connections are made as the default group's are: the addresses meet in the default
group's store (the job's authenticated store, once gpuwatch.inplace.groupproof formed that group), but
the connections themselves are not authenticated, so a stranger who connects first to a new gloo
listener holds a member's pair. install() wraps torch's `new_group` and `split_group` (what
`new_subgroups`, `init_device_mesh` and `DeviceMesh` call) so that, while the default group is one that
proved itself, the members of each new group run groupproof's proof over it before the script gets
it: nonces and verdicts in the default group's store under the group's name, one all-gather of HMACs
over the new group. A group that fails is taken down on every member (its own connections shut down
first, so no member waits on a stranger) and formed again by its members alone
(`use_local_synchronization`), one line and a count each time; after groupproof.ATTEMPTS the call
raises GroupProofError. Ranks outside the group get torch's non-member handle at once, as before.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gpuwatch.inplace import groupproof
from gpuwatch.inplace.sockets import shut_down, socket_inodes

# The proof's all-gather moves 32 bytes between members that all reached it: only a stranger's pair
# stalls it. Bounded apart from the group's timeout (gloo's default is 30 minutes).
PROOF_WAIT_S = 60.0
_POLL_S = 0.02
_HOLDERS = ("torch.distributed.distributed_c10d", "torch.distributed", "torch.distributed.device_mesh")
_MARK = "_gpuwatch_proves"
Again = Callable[[Callable[..., Any], dict[str, Any]], Callable[[list[int]], Any]]  # how members form it again
# group name -> groups of that name proved under the current default group (their keys), and that group's
# store: a new default group (an in-place job's next generation; a replacement starts at 0) starts over.
_proofs: dict[str, int] = {}
_counted_for: list[dist.Store] = []


def install() -> None:
    """Wrap torch's new_group and split_group in every module that holds them by name (idempotent)."""
    for name, again in (("new_group", _new_group_again), ("split_group", _split_group_again)):
        original = getattr(c10d, name, None)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapped = _proving(original, again)
        setattr(wrapped, _MARK, True)
        for holder in _HOLDERS:
            module = importlib.import_module(holder)
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def _proving(original: Callable[..., Any], again: Again) -> Callable[..., Any]:
    """`original` (new_group or split_group), returning only a group that proved itself."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def proving(*args: Any, **kwargs: Any) -> Any:
        proved = groupproof.proved()
        if proved is None:  # the default group did not prove itself (the script chose its own store): as asked
            return original(*args, **kwargs)
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        before = socket_inodes()
        group = original(*args, **kwargs)
        return _proved(group, before, proved, given.arguments["timeout"], again(original, given.arguments))

    return proving


def _new_group_again(original: Callable[..., Any], asked: dict[str, Any]) -> Callable[[list[int]], Any]:
    """A refused new_group formed again by its members alone, as the script asked for it."""
    keys = ("timeout", "backend", "pg_options", "group_desc", "device_id", "sort_ranks")
    again = {k: asked[k] for k in keys if k in asked}
    return lambda ranks: original(ranks, **again, use_local_synchronization=True)


def _split_group_again(_: Callable[..., Any], asked: dict[str, Any]) -> Callable[[list[int]], Any]:
    """A refused split_group's group formed again by its members alone, through (torch's own) new_group."""
    again = {"timeout": asked["timeout"], "group_desc": asked["group_desc"]}
    return lambda ranks: inspect.unwrap(c10d.new_group)(ranks, **again, use_local_synchronization=True)


def _proved(
    group: Any,
    before: dict[int, int],
    proved: tuple[dist.Store, bytes],
    timeout: datetime.timedelta | None,
    again: Callable[[list[int]], Any],
) -> Any:
    """`group` once it proved itself, or the group its members formed again in its place."""
    if not isinstance(group, dist.ProcessGroup):  # not a member (torch's non-member handle, or None)
        return group
    store, secret = proved
    name, ranks = group.group_name, dist.get_process_group_ranks(group)
    rank, world = group.rank(), group.size()
    if not _counted_for or _counted_for[0] is not store:
        _proofs.clear()
        _counted_for[:] = [store]
    seq = _proofs[name] = _proofs.get(name, 0) + 1
    wait = timeout or c10d.default_pg_timeout
    device = groupproof.proof_device(str(dist.get_backend(group)), getattr(group, "bound_device_id", None))
    opened = {fd: ino for fd, ino in socket_inodes().items() if before.get(fd) != ino}

    def form(attempt: int) -> Any:
        nonlocal opened
        if attempt == 0:
            return group
        start = socket_inodes()
        with _named(f"{name}.{seq}.{attempt}"):  # a name of its own: the refused one's keys are still in the store
            made = again(ranks)
        opened = {fd: ino for fd, ino in socket_inodes().items() if start.get(fd) != ino}
        return made

    def destroy(made: Any) -> None:
        shut_down(opened)  # a member still waiting on a stranger's pair gets "connection closed" now
        if isinstance(made, dist.ProcessGroup):
            with contextlib.suppress(Exception):  # a group a stranger broke may not shut down cleanly
                dist.destroy_process_group(made)

    _, good = groupproof.until_proved(
        form, lambda attempt: dist.PrefixStore(f"gpuwatch-proof/{name}/{seq}/{attempt}", store), destroy,
        secret, rank, world, wait, device, f"{name} (ranks {', '.join(map(str, ranks))})", _bounded_gather,
    )  # fmt: skip
    return good


@contextlib.contextmanager
def _named(name: str) -> Iterator[None]:
    """torch names a members-only group by its ranks and the process's group count, which a refused
    group's destruction gives back: its successor would read the refused group's addresses."""
    original = c10d._process_group_name
    c10d._process_group_name = lambda ranks, use_hashed_name: name  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        c10d._process_group_name = original


def _bounded_gather(
    group: dist.ProcessGroup, proofs: dist.Store, gathered: list[torch.Tensor], mine: torch.Tensor
) -> None:
    """The proof's all-gather, given up when a member already refused the group or PROOF_WAIT_S passed."""
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    assert work is not None  # async_op=True always returns its Work
    others = [f"verdict/{r}" for r in range(group.size()) if r != group.rank()]
    deadline = time.monotonic() + PROOF_WAIT_S
    while not work.is_completed():
        refused = [k for k in others if proofs.check([k]) and proofs.get(k) != b"ok"]
        if refused:
            raise RuntimeError(f"rank {refused[0].rpartition('/')[2]} refused the group before its proof came")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no proof within {PROOF_WAIT_S:.0f} s")
        time.sleep(_POLL_S)
    work.wait()
