"""Copy a data-parallel rank's whole training state to the ranks that lack it, over the process group.

A joining rank (a released GPU, a replacement) or a survivor that is a step behind gets the model's
state_dict, the optimizer's state and param_groups, and any other small state (a scheduler) from
one source rank: first the layout as one pickled object (names, shapes, dtypes; no tensor data),
then the tensors' bytes by broadcast in chunks of at most `chunk_bytes`, written straight into the
receivers' own tensors. So the extra memory is one chunk, whatever the state's size, and nothing
touches the disk. Every rank of the group calls it (a broadcast reaches all ranks: a rank that is in
sync receives its own bytes back, a no-op).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 64 << 20


class Stateful(Protocol):
    """Anything with state_dict()/load_state_dict() (a scheduler, a data sampler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class _TensorLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _layout(value: Any) -> Any:
    """A state_dict with each tensor replaced by its layout (what a receiver needs to allocate it)."""
    if isinstance(value, torch.Tensor):
        return _TensorLayout(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _layout(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_layout(v) for v in value)
    return value


def _allocate(value: Any, device: torch.device) -> Any:
    if isinstance(value, _TensorLayout):
        return torch.empty(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, dict):
        return {k: _allocate(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_allocate(v, device) for v in value)
    return value


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors, the same order on every rank (param index, then key)."""
    state = optimizer.state_dict()["state"]
    return [v for index in sorted(state) for _, v in sorted(state[index].items()) if isinstance(v, torch.Tensor)]


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state, views of the live storage (writing them writes the state)."""
    return [*model.state_dict(keep_vars=True).values(), *_optimizer_tensors(optimizer)]


def send_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    others: dict[str, Stateful],
    step: int,
    src: int,
    group: Any = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[int, int]:
    """Make every rank of `group` hold `src`'s state; the step and the bytes moved.

    Args:
        model, optimizer: the same architecture on every rank (the receivers' tensors are overwritten).
        others: small state objects, sent pickled.
        step: the source's step (the receivers' value is ignored).
        src: the group rank that holds the state.
        chunk_bytes: the most bytes one broadcast carries (the extra memory).
    """
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    rank = dist.get_rank(group)
    header: list[Any] = [None]
    if rank == src:
        optim_state = optimizer.state_dict()
        header[0] = {
            "step": step,
            "optimizer": {"state": _layout(optim_state["state"]), "param_groups": optim_state["param_groups"]},
            "others": {name: obj.state_dict() for name, obj in others.items()},
        }
    dist.broadcast_object_list(header, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    body = header[0]
    if rank != src:
        optimizer.load_state_dict(
            {"state": _allocate(body["optimizer"]["state"], device), "param_groups": body["optimizer"]["param_groups"]}
        )
        for name, obj in others.items():
            obj.load_state_dict(body["others"][name])
    tensors = state_tensors(model, optimizer)
    moved = _broadcast_tensors(tensors, src, group, chunk_bytes, device)
    return int(body["step"]), moved


def _broadcast_tensors(
    tensors: list[torch.Tensor], src: int, group: Any, chunk_bytes: int, device: torch.device
) -> int:
    """Broadcast the tensors' bytes in chunks: big tensors slice by slice in place, small ones packed."""
    global_src = dist.get_global_rank(group, src) if group is not None else src
    buffer = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    rank = dist.get_rank(group)
    moved = 0
    pending: list[torch.Tensor] = []
    used = 0

    def flush() -> None:
        nonlocal used, pending
        if not pending:
            return
        if rank == src:
            offset = 0
            for t in pending:
                n = t.numel() * t.element_size()
                buffer[offset : offset + n].copy_(_bytes(t))
                offset += n
        dist.broadcast(buffer[:used], src=global_src, group=group)
        if rank != src:
            offset = 0
            for t in pending:
                n = t.numel() * t.element_size()
                _bytes(t).copy_(buffer[offset : offset + n])
                offset += n
        pending, used = [], 0

    for tensor in tensors:
        data = tensor.detach()
        n = data.numel() * data.element_size()
        moved += n
        if n == 0:
            continue
        if n > chunk_bytes // 4:  # a big tensor goes slice by slice, straight into the receiver's storage
            flush()
            flat = _bytes(data)
            for start in range(0, n, chunk_bytes):
                dist.broadcast(flat[start : start + chunk_bytes], src=global_src, group=group)
            continue
        if used + n > chunk_bytes:
            flush()
        pending.append(data)
        used += n
    flush()
    return moved


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-d included): the same storage, read or written."""
    if not tensor.is_contiguous():
        raise ValueError("state tensors must be contiguous to be sent in place")
    return tensor.reshape(-1).view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


def checksum(model: torch.nn.Module) -> str:
    """A digest of the model's parameters and buffers: equal on every rank of a job in sync.

    Two float64 sums per tensor (plain and position-weighted), so a swapped or changed value shows.
    """
    parts = []
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
        parts.append(f"{name}:{float(flat.sum()).hex()}:{float((flat * weights).sum()).hex()}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
