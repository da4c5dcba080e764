"""Reading committed slots back: which steps a rank can restore, and the state of one of them.

The rank's own slot is mapped copy-on-write and its tensors are views of the mapping (no copy:
memory speed is the checksum's speed; an update of the restored state copies only the pages it
writes, the slot stays as committed). The file is never written again: when a later snapshot needs
that slot, its name is unlinked and a new file made (HostSnapshot). Another rank's slot (replicated
state) is read with pread into fresh tensors instead, since its owner will write into it again. Either
way every chunk's crc32 is checked before the state is handed out, so a torn or changed slot is
refused as a whole. Only regular files of this uid are opened, without following links.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import mmap
import os
import stat
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpuwatch.snapshots.layout import names_in, parse_slot_name
from gpuwatch.snapshots.slot import HEADER_LEN, SlotHeader, read_header
from gpuwatch.trainer import tensorfile

_OPEN = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
RESTORE_WORKERS = max(4, min(16, os.cpu_count() or 1))
"""Threads a restore onto the GPU reads with: a core each, up to 16 (pread from /dev/shm went 19 GiB/s on 8
threads of an H200's host and 32 GiB/s on 16; crc32 53 and 104 GiB/s)."""
PIECE = tensorfile.CHUNK
"""Bytes a restore worker reads, checks and copies at a time, whatever the slot's chunk: its buffers' size."""

_pinned: list[Any] = []  # the restore's pinned buffers no read holds now, kept for the process's next restore
_pinned_lock = threading.Lock()


@dataclass(frozen=True)
class Candidate:
    """A committed slot this rank may restore from."""

    name: str
    rank: int
    slot: int
    header: SlotHeader


def candidates(dir_fd: int, *, rank: int, world_size: int, replicated: bool) -> list[Candidate]:
    """The committed slots in the job directory this rank may load, newest first.

    Sharded state (replicated False): only this rank's own slots, written by a job of the same world
    size (another world would hold other shards). Replicated state (data parallel): any rank's slot
    of the job, whatever its world size: each holds the whole state.
    """
    found = []
    for name in names_in(dir_fd):
        parsed = parse_slot_name(name)
        if parsed is None or name.endswith(".tmp"):
            continue
        slot_rank, slot = parsed
        if not replicated and slot_rank != rank:
            continue
        header = header_of(dir_fd, name)
        if header is None or (not replicated and (header.world_size != world_size or header.rank != rank)):
            continue
        found.append(Candidate(name, slot_rank, slot, header))
    own_first = sorted(found, key=lambda c: (c.rank != rank, c.rank, -c.header.seq))
    return sorted(own_first, key=lambda c: -c.header.step)


def header_of(dir_fd: int, name: str) -> SlotHeader | None:
    """The committed header of slot file `name` (a regular file of ours), else None."""
    fd = _open_own(dir_fd, name)
    if fd is None:
        return None
    try:
        return read_header(fd)
    finally:
        os.close(fd)


def _open_own(dir_fd: int, name: str, mode: int = os.O_RDONLY) -> int | None:
    """An fd of `name` when it is a regular file of this uid (never through a link), else None."""
    try:
        fd = os.open(name, _OPEN | mode, dir_fd=dir_fd)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd


def _open_listed(dir_fd: int, candidate: Candidate) -> tuple[int, SlotHeader] | str:
    """An fd of the candidate's slot and its header while it is still the commit that was listed, else why not."""
    fd = _open_own(dir_fd, candidate.name)
    if fd is None:
        return "cannot open it"
    header = read_header(fd)
    if header is None or header.seq != candidate.header.seq or header.step != candidate.header.step:
        os.close(fd)
        return "rewritten since it was listed"
    return fd, header


def map_state(dir_fd: int, candidate: Candidate) -> tuple[Any, str | None]:
    """The state in one of this rank's committed slots, as views of its private mapping, every chunk verified first."""
    opened = _open_listed(dir_fd, candidate)
    if isinstance(opened, str):
        return None, opened
    fd, header = opened
    try:
        # Copy-on-write, so the slot stays as committed; not MAP_POPULATE, which would copy every page now.
        size = HEADER_LEN + header.payload_len
        memory = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        return None, f"cannot map it: {exc}"
    finally:
        os.close(fd)
    view = memoryview(memory)[HEADER_LEN : HEADER_LEN + header.payload_len]
    try:
        chunks = header.chunks()
        crcs = tensorfile._parallel(_crc_in(view), chunks, tensorfile.workers())
        for chunk, crc in zip(chunks, crcs, strict=True):
            if crc != chunk.crc:
                return None, f"crc32 mismatch in bytes {chunk.offset}-{chunk.offset + chunk.length}"
        tree, records, _ = tensorfile.parse_prefix(bytes(view[: header.data_off]), header.payload_len)
        tensors = tensorfile.views_of(memory, HEADER_LEN, records)
        return tensorfile.build_state(tree, tensorfile.finish_tensors(records, tensors)), None
    except tensorfile.FlatFileError as exc:
        return None, str(exc)
    finally:
        view.release()


def _crc_in(view: memoryview) -> Any:
    return lambda c: tensorfile.crc32(view[c.offset : c.offset + c.length])


def read_state(dir_fd: int, candidate: Candidate) -> tuple[Any, str | None]:
    """The state in a committed slot, copied into fresh tensors and verified chunk by chunk; (None, reason) if not."""
    opened = _open_listed(dir_fd, candidate)
    if isinstance(opened, str):
        return None, opened
    fd, header = opened
    try:
        state = tensorfile.read_flat(fd, header.payload_len, header.chunks(), base=HEADER_LEN)
        after = read_header(fd)
        if after is None or after.seq != header.seq:
            return None, "rewritten while it was read"
        return state, None
    except tensorfile.FlatFileError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read it: {exc}"
    finally:
        os.close(fd)


def on_cuda(device: Any) -> bool:
    """Whether a restore onto `device` (a torch.device, its name, or None for host memory) reads onto a GPU."""
    return device is not None and str(device).startswith("cuda")


def read_to_device(dir_fd: int, candidate: Candidate, device: Any) -> tuple[Any, str | None]:
    """The state in a committed slot, its tensors on `device` (a CUDA one), verified chunk by chunk as they go.

    Each worker reads its chunks a piece at a time into its own pinned buffers (pread: no page faults in
    this process), checks their crc32 there, and copies each piece to the GPU on its own stream while it
    reads the next: the copy and the verification overlap, at memory speed. The tensors are views of one
    buffer on the device; 0-dim tensors (an optimizer's step counters, which torch keeps on the CPU) stay
    on the CPU. Nothing is handed out before every chunk matched.
    """
    torch = sys.modules["torch"]
    opened = _open_listed(dir_fd, candidate)
    if isinstance(opened, str):
        return None, opened
    fd, header = opened
    try:
        chunks = header.chunks()
        prefix = os.pread(fd, header.data_off, HEADER_LEN)
        if len(prefix) != header.data_off or tensorfile.crc32(prefix) != chunks[0].crc:
            return None, "crc32 mismatch in its structure"
        tree, records, _ = tensorfile.parse_prefix(prefix, header.payload_len)
        flat = torch.empty(header.payload_len, dtype=torch.uint8, device=device)
        bad = _to_device(fd, chunks[1:], flat)
        if bad is not None:
            return None, f"crc32 mismatch in bytes {bad.offset}-{bad.offset + bad.length}"
        after = read_header(fd)
        if after is None or after.seq != header.seq:
            return None, "rewritten while it was read"
        tensors = [_view(torch, flat, r) for r in records]
        return tensorfile.build_state(tree, tensorfile.finish_tensors(records, tensors)), None
    except tensorfile.FlatFileError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read it: {exc}"
    finally:
        os.close(fd)


def _to_device(fd: int, chunks: list[tensorfile.Chunk], flat: Any) -> tensorfile.Chunk | None:
    """pread, crc32 and copy each chunk into `flat`, a PIECE at a time; the first chunk that does not verify, else None.

    On a CUDA device the buffers are pinned (pinned_buffers: kept from an earlier restore, or pinned by a
    standby while it waited) and each worker copies on its own stream (two buffers each: one is read and
    checked while the other goes to the GPU).
    """
    torch = sys.modules["torch"]
    cuda = flat.device.type == "cuda"
    n = min(RESTORE_WORKERS, max(1, len(chunks)))
    queues = [chunks[i::n] for i in range(n)]

    def worker(k: int) -> tensorfile.Chunk | None:
        mine, pair = queues[k], buffers[2 * k : 2 * k + 2]
        events: list[Any] = [None, None]
        stream = torch.cuda.Stream(device=flat.device) if cuda else None
        turn = 0
        try:
            for chunk in mine:
                crc = 0
                for at in range(0, chunk.length, PIECE):
                    length, i = min(PIECE, chunk.length - at), turn % 2
                    turn += 1
                    if events[i] is not None:
                        events[i].synchronize()  # its last copy to the GPU is done: the buffer may be refilled
                    view = memoryview(pair[i].numpy())[:length]
                    if os.preadv(fd, [view], HEADER_LEN + chunk.offset + at) != length:
                        return chunk
                    crc = tensorfile.crc32(view, crc)
                    start = chunk.offset + at
                    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                        flat[start : start + length].copy_(pair[i][:length], non_blocking=cuda)
                    if cuda:
                        events[i] = torch.cuda.Event()
                        events[i].record(stream)
                if crc != chunk.crc:
                    return chunk
            return None
        finally:
            if stream is not None:  # no copy still reads a buffer once the buffers go back
                stream.synchronize()

    lend: contextlib.AbstractContextManager[list[Any]]
    if cuda:
        lend = pinned_buffers(2 * n)
    else:
        lend = contextlib.nullcontext([torch.empty(PIECE, dtype=torch.uint8) for _ in range(2 * n)])
    with lend as buffers, concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="gpuwatch-restore") as pool:
        bad = [b for b in pool.map(worker, range(n)) if b is not None]
    return bad[0] if bad else None


@contextlib.contextmanager
def pinned_buffers(count: int) -> Iterator[list[Any]]:
    """`count` pinned host buffers of PIECE bytes, lent to one read for as long as it runs, then kept for the
    process's next restore.

    Pinning is the slow part of a restore's set-up: 0.42 s of a 0.98 s restore of 16 GiB onto an H100
    (0.56 s with them pinned already), hence pin_restore_buffers for a standby. A read that starts while
    another holds them pins buffers of its own: two reads never fill the same buffer.
    """
    with _pinned_lock:
        lent = _pinned[:count]
        del _pinned[:count]
    try:
        while len(lent) < count:
            lent.append(_pin_piece())
        yield lent
    finally:
        with _pinned_lock:
            _pinned.extend(lent)


def _pin_piece() -> Any:
    torch = sys.modules["torch"]
    return torch.empty(PIECE, dtype=torch.uint8, pin_memory=True)


def pin_restore_buffers() -> int:
    """Pin the buffers a restore onto the GPU reads through, now (a standby, before its hand-over); their bytes."""
    with pinned_buffers(2 * RESTORE_WORKERS):
        return 2 * RESTORE_WORKERS * PIECE


def _view(torch: Any, flat: Any, record: tensorfile.TensorRecord) -> Any:
    """The record's tensor as a view of `flat` (0-dim ones as CPU copies: see read_to_device)."""
    dtype, numel = tensorfile._dtype_and_numel(record)
    if not numel:
        return torch.empty(record.shape, dtype=dtype)
    tensor = flat[record.offset : record.offset + record.nbytes].view(dtype).view(record.shape)
    return tensor.cpu() if not record.shape else tensor


def localize(state: Any) -> Any:
    """`state` with each DTensor replaced by its local shard (a view: no copy); other values as they are."""
    if _is_dtensor(state):
        return state.to_local()
    if isinstance(state, dict):
        return _same_kind(state, [(k, localize(v)) for k, v in state.items()])
    if isinstance(state, list):
        return [localize(v) for v in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(localize(v) for v in state)
    return state


def like(state: Any, template: Any) -> Any:
    """`state` (local shards where the template has DTensors) with those shards made DTensors again.

    Each one gets the template's mesh, placements, global shape and stride, on the template's device:
    what `torch.distributed.checkpoint.state_dict.set_state_dict` takes. Values the template does
    not have, and every other value, stay as restored.
    """
    if _is_dtensor(template):
        torch = sys.modules["torch"]
        if not isinstance(state, torch.Tensor):
            return state
        local = template.to_local()
        shard = state.to(device=local.device, dtype=local.dtype)
        cls = type(template)
        return cls.from_local(
            shard, template.device_mesh, template.placements, run_check=False, shape=template.shape,
            stride=template.stride(),
        )  # fmt: skip
    if isinstance(state, dict) and isinstance(template, dict):
        return _same_kind(state, [(k, like(v, template[k]) if k in template else v) for k, v in state.items()])
    if isinstance(state, list | tuple) and isinstance(template, list | tuple) and len(state) == len(template):
        items = [like(s, t) for s, t in zip(state, template, strict=True)]
        return items if isinstance(state, list) else tuple(items)
    return state


def _same_kind(original: dict[Any, Any], items: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """An OrderedDict stays one (a state dict is); any other mapping becomes a dict."""
    return collections.OrderedDict(items) if isinstance(original, collections.OrderedDict) else dict(items)


def _is_dtensor(value: Any) -> bool:
    return hasattr(value, "to_local") and hasattr(value, "placements") and hasattr(value, "device_mesh")
