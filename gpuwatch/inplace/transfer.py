"""Copy a data-parallel rank's whole training state to the ranks that lack it, over the process group.

A joining rank (a released GPU, a replacement) or a survivor that is a step behind gets the model's
state_dict, the optimizer's state and param_groups, and any other small state (a scheduler) from
one source rank: first the layout as data (JSON: names, shapes, dtypes, no tensor data; nothing a
peer sends is ever unpickled, so a stranger in the group cannot run code in a receiver), then the
tensors' bytes by broadcast in chunks of at most `chunk_bytes`, written straight into the
receivers' own tensors. So the extra memory is one chunk, whatever the state's size, and nothing
touches the disk. Every rank of the group calls it (a broadcast reaches all ranks: a rank that is in
sync receives its own bytes back, a no-op).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gpuwatch.errors import InPlaceError

DEFAULT_CHUNK_BYTES = 64 << 20
MAX_HEADER_BYTES = 256 << 20  # a header longer than this is refused before it is received


class HeaderError(InPlaceError, ValueError):
    """A state header that is not what send_state writes (one line: what is wrong)."""


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
        others: small state objects; their state_dicts travel as data (containers, numbers, strings,
            bytes, small tensors), and anything else is a TypeError at the source.
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
    body = _broadcast_header(header[0], rank == src, src, group, device)
    if rank != src:
        optimizer.load_state_dict(
            {"state": _allocate(body["optimizer"]["state"], device), "param_groups": body["optimizer"]["param_groups"]}
        )
        for name, obj in others.items():
            obj.load_state_dict(body["others"][name])
    tensors = state_tensors(model, optimizer)
    moved = _broadcast_tensors(tensors, src, group, chunk_bytes, device)
    return int(body["step"]), moved


def _broadcast_header(header: Any, is_src: bool, src: int, group: Any, device: torch.device) -> Any:
    """The source's header on every rank: its length, then its JSON bytes (never a pickle)."""
    global_src = dist.get_global_rank(group, src) if group is not None else src
    data, unsendable = b"", None
    if is_src:
        try:
            data = json.dumps(encode(header), separators=(",", ":")).encode()
        except TypeError as exc:  # still tell the receivers (an empty header), so they fail too, not wait
            unsendable = exc
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=global_src, group=group)
    if unsendable is not None:
        raise unsendable
    size = int(length.item())
    if not 0 < size <= MAX_HEADER_BYTES:
        raise HeaderError(f"a state header of {size} bytes (at most {MAX_HEADER_BYTES})")
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    if is_src:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=global_src, group=group)
    if is_src:
        return header
    received = bytearray(size)
    torch.frombuffer(received, dtype=torch.uint8).copy_(buffer)
    try:
        return decode(json.loads(received))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise HeaderError(f"a state header that is not one send_state writes: {exc}") from None


# The header's JSON: plain values as they are; anything JSON cannot say (a tuple, a dict with int
# keys, a layout, a small tensor, bytes, a float JSON has no word for) as a one-key object of a tag.


def encode(value: Any) -> Any:
    """`value` as JSON-able data that `decode` turns back into an equal value.

    Raises:
        TypeError: a value of a type the header does not carry (an object of a class of yours).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"float": repr(value)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, _TensorLayout):
        return {"layout": [list(value.shape), str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").reshape(-1)
        return {"tensor": [list(value.shape), str(value.dtype).removeprefix("torch."), encode(flat.tolist())]}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    raise TypeError(f"the in-place state carries no {type(value).__name__} (only plain values and tensors)")


def decode(data: Any) -> Any:
    """The value `encode` made `data` of; a ValueError for anything it does not make."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"unexpected {type(data).__name__} in a state header")
    ((tag, body),) = data.items()
    if tag == "tuple":
        return tuple(decode(v) for v in _list(body))
    if tag == "dict":
        return {_key(decode(k)): decode(v) for k, v in (_pair(item) for item in _list(body))}
    if tag == "float":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError(f"float {body!r}")
        return float(body)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "layout":
        shape, dtype = _list(body)
        return _TensorLayout(_shape(shape), _dtype(dtype))
    if tag == "tensor":
        shape, dtype, values = _list(body)
        return torch.tensor(decode(values), dtype=_dtype(dtype)).reshape(_shape(shape))
    raise ValueError(f"unknown tag {tag!r} in a state header")


def _list(body: Any) -> list[Any]:
    if not isinstance(body, list):
        raise ValueError(f"expected a list, not {type(body).__name__}")
    return body


def _pair(item: Any) -> tuple[Any, Any]:
    key, value = _list(item)
    return key, value


def _key(key: Any) -> Any:
    if not isinstance(key, (str, int, float, bool, tuple)) and key is not None:
        raise ValueError(f"a dict key of type {type(key).__name__}")
    return key


def _shape(shape: Any) -> tuple[int, ...]:
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in _list(shape)):
        raise ValueError(f"shape {shape!r}")
    return tuple(shape)


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r}")
    return dtype


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
