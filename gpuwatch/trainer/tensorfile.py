"""A flat file of tensors: what a checkpoint and a host snapshot hold, moved at the disk's (or memory's) speed.

torch.save sends every storage through a zip writer that computes its own CRC-32 as it goes
(measured on a 2-core VM: 0.12 GiB/s for the whole save), and load_latest used to hash the file
with sha256 on one core before torch.load read it a second time. A flat file instead is

    [header, 4 KiB][meta: the state's structure, pickled, each tensor a reference][tensor bytes]

with the data section 4 KiB aligned and every tensor 64-byte aligned in it, so the bytes go from
tensors to the file and back in 16 MiB chunks, with O_DIRECT where the file system has it, and a
pool of threads copies, checksums and writes (or reads) several chunks at once.

The checksum is zlib.crc32 per chunk: the fastest the stdlib has (measured on a 2-core VM: crc32 1.6 GiB/s
a core, adler32 1.2, sha1 and sha256 0.8, blake2b 0.7), and zlib releases the GIL, so the chunks are
checksummed on every core at once. Where the optional `isal` package is installed, its crc32 (the same
value, computed with the CPU's carry-less multiply: about 20 GiB/s a core against zlib's 1.6) is used
instead. `Chunk`s (offset, length, crc) tile the file; the first covers
the header and the meta, so a reader verifies the structure before it unpickles it, then reads
and verifies every data chunk and hands out nothing before all of them match.

The structure is unpickled by an allow-list unpickler (containers, numbers, strings, bytes,
torch.Size, dtypes, devices: what torch.load(weights_only=True) accepts in a state dict); a state
holding anything else (custom objects, tensor subclasses such as DTensor, sparse or quantized
tensors) is not flat: `plan` returns None and the caller uses torch.save. Two views of one storage
are written as two tensors (a tensor that appears twice, such as a tied weight, is written once).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import ctypes
import io
import math
import mmap
import os
import pickle
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from gpuwatch.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MAGIC = b"GWFLAT01"
PAGE = 4096  # section alignment: O_DIRECT wants offsets, lengths and buffers aligned to the block size
TENSOR_ALIGN = 64
DIRECT_MIN = 1 << 20  # a tensor this large starts on a page in the file and in memory: it is read with O_DIRECT
CHUNK = 16 << 20
HEADER = struct.Struct("<8sIIQQQQ")  # magic, version, flags, meta_off, meta_len, data_off, data_len
VERSION = 1
MAX_WORKERS = 8
MAX_PREFIX = 1 << 30  # header and structure: a million tensors' records are ~100 MiB

try:  # the same crc32 as zlib's, an order of magnitude faster (optional: pip install isal)
    from isal.isal_zlib import crc32 as crc32  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as crc32

_TORCH_GLOBALS = {"Size", "device"}
_BUILTIN_GLOBALS = {"complex", "slice", "set", "frozenset"}


class FlatFileError(CheckpointError):
    """A flat file that does not verify or parse; the message is the reason."""


class Chunk(NamedTuple):
    """A checksummed byte range of a file; a file's chunks tile it."""

    offset: int
    length: int
    crc: int


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes are in the file, and how to rebuild it."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    parameter: bool = False
    requires_grad: bool = False


@dataclass
class FlatState:
    """A state laid out as a flat file: the prefix bytes (header and meta), and each tensor's source bytes."""

    prefix: bytes
    records: list[TensorRecord]
    sources: list[torch.Tensor]  # each a contiguous 1-D uint8 view of its tensor, on the tensor's device
    data_off: int
    size: int

    def chunk_ranges(self, chunk: int = CHUNK) -> list[tuple[int, int]]:
        """The (offset, length) ranges the file's chunks cover: the prefix, then the data in `chunk` pieces."""
        return chunk_ranges(self.data_off, self.size, chunk)


def chunk_ranges(data_off: int, size: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """[0, data_off) as one chunk (header and meta), then [data_off, size) cut into `chunk`-byte pieces."""
    ranges = [(0, data_off)]
    ranges += [(off, min(chunk, size - off)) for off in range(data_off, size, chunk)]
    return ranges


def chunk_count(data_off: int, size: int, chunk: int = CHUNK) -> int:
    """len(chunk_ranges(data_off, size, chunk)) without making the list (a slot's header is read at each snapshot).

    Raises:
        ValueError: chunk is not positive (as range() does for chunk_ranges).
    """
    if chunk <= 0:
        raise ValueError(f"chunk size {chunk} is not positive")
    return 1 + max(0, -(-(size - data_off) // chunk))


def plan(state: Any) -> FlatState | None:
    """Lay `state` out as a flat file, or None when it holds something a flat file cannot (see the module doc).

    Nothing is copied: the sources are views of the state's own tensors (a non-contiguous one is
    made contiguous on its device).
    """
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    records: list[TensorRecord] = []
    sources: list[Any] = []
    index_of: dict[tuple[Any, ...], int] = {}
    offset = 0
    after_large = False

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            nonlocal offset, after_large
            if not isinstance(obj, torch.Tensor):
                return None
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or not _plain(torch, obj):
                raise _NotFlat(f"{type(obj).__name__} with layout {obj.layout}")
            where = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()))
            key = (obj.device, obj.dtype, *where)
            if key in index_of:
                return ("tensor", index_of[key])
            tensor = obj.detach().resolve_conj().resolve_neg()
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            large = flat.numel() >= DIRECT_MIN
            offset = _align(offset, PAGE if large or after_large else TENSOR_ALIGN)  # a large one has its pages
            after_large = large
            records.append(
                TensorRecord(
                    dtype=str(obj.dtype).removeprefix("torch."),
                    shape=tuple(obj.shape),
                    offset=offset,
                    nbytes=flat.numel(),
                    parameter=isinstance(obj, torch.nn.Parameter),
                    requires_grad=obj.requires_grad,
                )
            )
            sources.append(flat)
            offset += flat.numel()
            index_of[key] = len(records) - 1
            return ("tensor", len(records) - 1)

    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=4).dump(state)
        tree = buffer.getvalue()
        meta = pickle.dumps({"tree": tree, "tensors": [_record_tuple(r) for r in records]}, protocol=4)
        _check_loadable(tree)
    except _NotFlat:
        return None
    except (pickle.PicklingError, TypeError, AttributeError):
        return None  # unpicklable here: torch.save says why, in the caller's fallback
    data_off = _align(PAGE + len(meta), PAGE)
    size = data_off + _align(offset, PAGE)
    header = HEADER.pack(MAGIC, VERSION, 0, PAGE, len(meta), data_off, offset)
    prefix = header.ljust(PAGE, b"\0") + meta
    prefix = prefix.ljust(data_off, b"\0")
    records = [_shifted(r, data_off) for r in records]
    return FlatState(prefix=prefix, records=records, sources=sources, data_off=data_off, size=size)


class _NotFlat(Exception):
    """The state holds something a flat file cannot."""


def _plain(torch: Any, tensor: torch.Tensor) -> bool:
    return bool(tensor.layout == torch.strided and not tensor.is_quantized and tensor.device.type != "meta")


def _record_tuple(r: TensorRecord) -> tuple[Any, ...]:
    return (r.dtype, r.shape, r.offset, r.nbytes, r.parameter, r.requires_grad)


def _shifted(r: TensorRecord, by: int) -> TensorRecord:
    return TensorRecord(r.dtype, r.shape, r.offset + by, r.nbytes, r.parameter, r.requires_grad)


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


# -- the allow-list unpickler ------------------------------------------------------------------------


class _Unpickler(pickle.Unpickler):
    """Containers, numbers, strings and a few torch value types; a tensor reference becomes tensors[i]."""

    def __init__(self, data: bytes, tensors: Sequence[Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in _BUILTIN_GLOBALS:
            return getattr(__import__("builtins"), name)
        torch = sys.modules.get("torch")
        if module == "torch" and torch is not None:
            value = getattr(torch, name, None)
            if name in _TORCH_GLOBALS or isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flat file")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "tensor" and isinstance(pid[1], int)):
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        if self._tensors is None:
            return None
        if not 0 <= pid[1] < len(self._tensors):
            raise pickle.UnpicklingError(f"tensor reference {pid[1]} out of range")
        return self._tensors[pid[1]]


def _check_loadable(tree: bytes) -> None:
    """Raise _NotFlat when the allow-list unpickler would refuse the structure (so the save falls back)."""
    try:
        _Unpickler(tree, None).load()
    except pickle.UnpicklingError as exc:
        raise _NotFlat(str(exc)) from None


def parse_prefix(prefix: bytes | memoryview, size: int) -> tuple[bytes, list[TensorRecord], int]:
    """The pickled tree, the tensor records and the data offset from a file's verified first chunk.

    Raises:
        FlatFileError: the header or the meta is malformed, or a record points outside the file.
    """
    if len(prefix) < HEADER.size:
        raise FlatFileError("shorter than its header")
    magic, version, _flags, meta_off, meta_len, data_off, data_len = HEADER.unpack_from(prefix)
    if magic != MAGIC or version != VERSION:
        raise FlatFileError(f"not a flat tensor file (magic {magic!r}, version {version})")
    if meta_off + meta_len > data_off or data_off != len(prefix) or data_off + data_len > size:
        raise FlatFileError("header points outside the file")
    try:
        meta = _Unpickler(bytes(prefix[meta_off : meta_off + meta_len]), None).load()
        tree, raw = meta["tree"], meta["tensors"]
        records = [
            TensorRecord(str(d), tuple(int(x) for x in s), data_off + int(o), int(n), bool(p), bool(g))
            for d, s, o, n, p, g in raw
        ]  # offsets in the meta count from the data section
    except Exception as exc:  # any malformed meta is one reason
        raise FlatFileError(f"meta unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(tree, bytes):
        raise FlatFileError("meta unreadable: no tree")
    for r in records:
        if r.offset < data_off or r.offset + r.nbytes > size or r.nbytes < 0:
            raise FlatFileError("a tensor record points outside the file")
    return tree, records, data_off


def build_state(tree: bytes, tensors: Sequence[Any]) -> Any:
    """The state from its pickled tree and its tensors (allow-list unpickler).

    Raises:
        FlatFileError: the tree names something not on the allow-list, or is malformed.
    """
    try:
        return _Unpickler(tree, tensors).load()
    except Exception as exc:  # an unpickler error of any kind: the file is not one we wrote
        raise FlatFileError(f"structure does not load: {type(exc).__name__}: {exc}") from None


def _dtype_and_numel(r: TensorRecord) -> tuple[torch.dtype, int]:
    """A record's dtype and element count, once its dtype is torch's and its shape matches its size."""
    import torch

    dtype = getattr(torch, r.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise FlatFileError(f"unknown dtype {r.dtype}")
    numel = math.prod(r.shape)
    if any(n < 0 for n in r.shape) or numel * torch.empty((), dtype=dtype).element_size() != r.nbytes:
        raise FlatFileError(f"a tensor record's size does not match its shape {r.shape}")
    return dtype, numel


def empty_tensors(records: Sequence[TensorRecord]) -> list[torch.Tensor]:
    """Fresh CPU tensors for the records, to read the file's bytes into (large ones on whole pages, for O_DIRECT)."""
    import torch

    tensors = []
    for r in records:
        dtype, numel = _dtype_and_numel(r)
        paged = r.nbytes >= DIRECT_MIN
        tensors.append(_paged_empty(torch, r.shape, dtype, numel) if paged else torch.empty(r.shape, dtype=dtype))
    return tensors


def views_of(buffer: Any, base: int, records: Sequence[TensorRecord]) -> list[torch.Tensor]:
    """Tensors that are views of `buffer` (a mapped flat file starting at `base`), one per record: no copy."""
    import torch

    tensors = []
    for r in records:
        dtype, numel = _dtype_and_numel(r)
        if not numel:
            tensors.append(torch.empty(r.shape, dtype=dtype))
            continue
        tensors.append(torch.frombuffer(buffer, dtype=dtype, count=numel, offset=base + r.offset).view(r.shape))
    return tensors


def _paged_empty(torch: Any, shape: tuple[int, ...], dtype: Any, numel: int) -> Any:
    """A CPU tensor on its own anonymous mapping: page aligned, freed with the tensor (it holds the mapping)."""
    memory = mmap.mmap(-1, _align(numel * torch.empty((), dtype=dtype).element_size(), PAGE))
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


def finish_tensors(records: Sequence[TensorRecord], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters and requires_grad as they were saved."""
    import torch

    out: list[torch.Tensor] = []
    for r, t in zip(records, tensors, strict=True):
        if r.parameter:
            out.append(torch.nn.Parameter(t, requires_grad=r.requires_grad))
        else:
            out.append(t.requires_grad_(r.requires_grad) if r.requires_grad else t)
    return out


# -- moving chunks ------------------------------------------------------------------------------------


def workers() -> int:
    """Threads for one file: a core each up to 8, and at least 4 (they wait on the disk; crc32 releases the GIL)."""
    return max(4, min(MAX_WORKERS, os.cpu_count() or 1))


def crc_of(buffers: Sequence[Any], crc: int = 0) -> int:
    """crc32 over buffers as if concatenated."""
    for buf in buffers:
        crc = crc32(buf, crc)
    return crc


@dataclass
class Piece:
    """Part of a chunk: a range of one source (a uint8 tensor) or of the prefix bytes, or zero padding."""

    at: int  # offset inside the chunk
    length: int
    source: Any  # torch.Tensor (uint8, 1-D), bytes, or None for zeros
    start: int  # offset inside the source


def _spans(flat: FlatState) -> list[tuple[int, int, Any]]:
    """(offset, length, source) of what the file holds, in file order: the prefix, then each tensor."""
    spans: list[tuple[int, int, Any]] = [(0, len(flat.prefix), flat.prefix)]
    return spans + [(r.offset, r.nbytes, s) for r, s in zip(flat.records, flat.sources, strict=True) if r.nbytes]


def pieces(spans: Sequence[tuple[int, int, Any]], offset: int, length: int) -> list[Piece]:
    """What the file holds in [offset, offset + length), in order; gaps are zero padding (source None)."""
    found: list[Piece] = []
    end = offset + length
    pos = offset
    for start, size, source in _overlapping(spans, offset, end):
        a, b = max(start, pos), min(start + size, end)
        if a > pos:
            found.append(Piece(pos - offset, a - pos, None, 0))
        found.append(Piece(a - offset, b - a, source, a - start))
        pos = b
    if pos < end:
        found.append(Piece(pos - offset, end - pos, None, 0))
    return found


def _overlapping(spans: Sequence[tuple[int, int, Any]], lo: int, hi: int) -> Iterator[tuple[int, int, Any]]:
    """The spans (sorted by start, not overlapping each other) that overlap [lo, hi)."""
    i = max(0, bisect.bisect_right(spans, lo, key=_first) - 1)
    for start, size, source in spans[i:]:
        if start >= hi:
            return
        if start + size > lo:
            yield start, size, source


class _Bounce:
    """A page-aligned buffer (anonymous mmap) for one worker: O_DIRECT's alignment, torch's GIL-free copies."""

    def __init__(self, size: int) -> None:
        import torch

        self.map = mmap.mmap(-1, max(size, PAGE))
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def view(self, length: int) -> memoryview:
        return memoryview(self.map)[:length]

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):
            self.map.close()


def write_flat(fd: int, flat: FlatState, chunk: int = CHUNK) -> list[Chunk]:
    """Write `flat` to the open file `fd` (O_DIRECT or not); its chunks with their crc32. No fsync.

    Each worker fills its page-aligned bounce buffer from the sources (torch copies: GIL-free, and a
    CUDA tensor is copied device-to-host a chunk at a time), checksums it and writes it at its offset.
    """
    ranges = flat.chunk_ranges(chunk)
    n = min(workers(), len(ranges))
    bounces = [_Bounce(max(length for _, length in ranges)) for _ in range(n)]
    free = list(bounces)
    spans = _spans(flat)

    def one(rng: tuple[int, int]) -> Chunk:
        offset, length = rng
        bounce = free.pop()
        try:
            _fill(bounce, pieces(spans, offset, length))
            view = bounce.view(length)
            crc = crc32(view)
            _pwrite_all(fd, view, offset)
            return Chunk(offset, length, crc)
        finally:
            free.append(bounce)

    try:
        return _parallel(one, ranges, n)
    finally:
        for bounce in bounces:
            bounce.close()


def write_buffer(fd: int, buffer: memoryview, chunks: Sequence[tuple[int, int]]) -> list[Chunk]:
    """Write a file that is already laid out in memory (a host snapshot's slot), chunk by chunk, with crc32s."""

    def one(rng: tuple[int, int]) -> Chunk:
        offset, length = rng
        view = buffer[offset : offset + length]
        crc = crc32(view)
        _pwrite_all(fd, view, offset)
        return Chunk(offset, length, crc)

    return _parallel(one, list(chunks), min(workers(), len(chunks)))


def _fill(bounce: _Bounce, pieces: list[Piece]) -> None:
    for piece in pieces:
        dst = bounce.tensor[piece.at : piece.at + piece.length]
        if piece.source is None:
            dst.zero_()
        elif isinstance(piece.source, bytes):
            bounce.map[piece.at : piece.at + piece.length] = piece.source[piece.start : piece.start + piece.length]
        else:
            dst.copy_(piece.source[piece.start : piece.start + piece.length])


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def read_flat(
    fd: int,
    size: int,
    chunks: Sequence[Chunk],
    map_location: Any = None,
    *,
    base: int = 0,
    direct_fd: int | None = None,
) -> Any:
    """The state in the flat file `fd` of `size` bytes, every chunk verified against `chunks` before it is returned.

    `base`: where the flat file starts in `fd` (a host snapshot's slot has a header before it).
    `direct_fd`: the same file opened with O_DIRECT: the page-aligned part of each large tensor is
    read through it, straight into the tensor (no page-cache copy: less CPU per byte).

    Raises:
        FlatFileError: a chunk's crc32 differs, the chunks do not tile the file, or the file does not parse.
    """
    check_tiling(chunks, size)
    first = chunks[0]
    if first.length > MAX_PREFIX:
        raise FlatFileError(f"first chunk of {first.length} bytes: more than a header and structure ({MAX_PREFIX})")
    prefix = bytearray(first.length)
    _preadv_all(fd, [memoryview(prefix)], base, first.length)
    if crc32(prefix) != first.crc:
        raise FlatFileError(f"crc32 mismatch in bytes 0-{first.length}")
    tree, records, data_off = parse_prefix(memoryview(prefix), size)
    tensors = empty_tensors(records)
    spans = sorted(((r.offset, r.nbytes, t) for r, t in zip(records, tensors, strict=True) if r.nbytes), key=_first)
    views = [(start, *_read_view(t, nbytes)) for start, nbytes, t in spans]

    def one(c: Chunk) -> tuple[Chunk, int]:
        buffers = []
        pos, end = c.offset, c.offset + c.length
        for start, nbytes, (view, address) in _overlapping(views, c.offset, end):
            a, b = max(start, pos), min(start + nbytes, end)
            if a > pos:
                buffers.append(_read(fd, bytearray(a - pos), base + pos))  # padding: checksummed, not kept
            buffers += _read_into(fd, direct_fd, view[a - start : b - start], address + a - start, base + a)
            pos = b
        if pos < end:
            buffers.append(_read(fd, bytearray(end - pos), base + pos))
        return c, crc_of(buffers)

    for chunk, crc in _parallel(one, list(chunks[1:]), min(workers(), len(chunks))):
        if crc != chunk.crc:
            raise FlatFileError(f"crc32 mismatch in bytes {chunk.offset}-{chunk.offset + chunk.length}")
    state = build_state(tree, finish_tensors(records, tensors))
    if map_location not in (None, "cpu"):
        state = _moved(state, map_location)
    return state


def _read_view(tensor: Any, nbytes: int) -> tuple[int, tuple[memoryview, int]]:
    """What a read fills for a tensor: its bytes; a large one's whole pages (its mapping has them, the file pads)."""
    length = _align(nbytes, PAGE) if nbytes >= DIRECT_MIN else nbytes
    view = memoryview((ctypes.c_char * length).from_address(tensor.data_ptr())).cast("B")
    return length, (view, tensor.data_ptr())


def _read_into(fd: int, direct_fd: int | None, view: memoryview, address: int, offset: int) -> list[memoryview]:
    """Fill `view` (at `address` in memory) from file `offset`: its page-aligned middle through O_DIRECT."""
    if direct_fd is None or len(view) < PAGE or (address - offset) % PAGE:
        return [_read(fd, view, offset)]
    head = (-address) % PAGE
    body = (len(view) - head) // PAGE * PAGE
    parts = [(fd, view[:head], offset), (direct_fd, view[head : head + body], offset + head)]
    parts.append((fd, view[head + body :], offset + head + body))
    return [_read(f, v, o) for f, v, o in parts if len(v)]


def _read(fd: int, buffer: bytearray | memoryview, offset: int) -> memoryview:
    view = memoryview(buffer)
    _preadv_all(fd, [view], offset, len(view))
    return view


def _first(span: tuple[int, int, Any]) -> int:
    return span[0]


def verify_fd(fd: int, size: int, chunks: Sequence[Chunk]) -> str | None:
    """Why the file's bytes do not match `chunks` (one line), or None when every chunk does.

    Each chunk is read in pieces of at most CHUNK bytes (memory stays bounded whatever length a
    manifest claims), and the first mismatch stops the rest.
    """
    try:
        check_tiling(chunks, size)
    except FlatFileError as exc:
        return str(exc)
    piece = min(CHUNK, max((c.length for c in chunks), default=0))
    n = min(workers(), max(1, len(chunks)))
    pool = [bytearray(piece) for _ in range(n)]
    failed: list[str] = []

    def one(c: Chunk) -> None:
        if failed:
            return
        buf = pool.pop()
        try:
            crc = 0
            for at in range(c.offset, c.offset + c.length, max(piece, 1)):
                view = memoryview(buf)[: min(piece, c.offset + c.length - at)]
                _preadv_all(fd, [view], at, len(view))
                crc = crc32(view, crc)
            if crc != c.crc:
                failed.append(f"crc32 mismatch in bytes {c.offset}-{c.offset + c.length}")
        finally:
            pool.append(buf)

    try:
        _parallel(one, list(chunks), n)
    except FlatFileError as exc:
        return str(exc)
    return min(failed, key=_start_of) if failed else None


def _start_of(reason: str) -> int:
    """The first byte a mismatch reason names, so the reported one is the earliest found."""
    return int(reason.rsplit(" ", 1)[1].split("-")[0])


def check_tiling(chunks: Sequence[Chunk], size: int) -> None:
    """Raise FlatFileError unless the chunks cover [0, size) in order with no gap or overlap."""
    pos = 0
    for c in chunks:
        if c.offset != pos or c.length < 0:
            raise FlatFileError("chunk list does not tile the file")
        pos += c.length
    if pos != size or not chunks:
        raise FlatFileError(f"chunk list covers {pos} bytes of {size}")


def chunks_of_fd(fd: int, size: int, chunk: int = CHUNK) -> list[Chunk]:
    """The crc32 chunks of a file written by someone else (DCP's shards), read in parallel."""
    ranges = [(off, min(chunk, size - off)) for off in range(0, size, chunk)] or [(0, 0)]
    n = min(workers(), len(ranges))
    pool = [bytearray(min(chunk, max(size, 1))) for _ in range(n)]

    def one(rng: tuple[int, int]) -> Chunk:
        offset, length = rng
        buf = pool.pop()
        try:
            view = memoryview(buf)[:length]
            _preadv_all(fd, [view], offset, length)
            return Chunk(offset, length, crc32(view))
        finally:
            pool.append(buf)

    return _parallel(one, ranges, n)


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, length: int) -> None:
    """Fill `buffers` (together `length` bytes) from `offset`; FlatFileError when the file ends first."""
    pending = [b for b in buffers if len(b)]
    done = 0
    while pending:
        got = os.preadv(fd, pending, offset + done)
        if got <= 0:
            raise FlatFileError(f"file ends at {offset + done}, {length - done} bytes short")
        done += got
        while pending and got >= len(pending[0]):
            got -= len(pending[0])
            pending.pop(0)
        if pending and got:
            pending[0] = pending[0][got:]


def _parallel(fn: Callable[[Any], Any], items: list[Any], n: int) -> list[Any]:
    """fn over items on n threads; on this thread when one would do (a small state: no pool to start)."""
    if n <= 1 or len(items) <= 2:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="gpuwatch-io") as pool:
        return list(pool.map(fn, items))


def _moved(state: Any, device: Any) -> Any:
    """`state` with every tensor moved to `device` (torch.load's map_location for a str or a torch.device)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, collections.OrderedDict):
        return collections.OrderedDict((k, _moved(v, device)) for k, v in state.items())
    if isinstance(state, dict):
        return {k: _moved(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_moved(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(_moved(v, device) for v in state)
    return state


def open_direct(path: str | os.PathLike[str]) -> int | None:
    """`path` opened read-only with O_DIRECT, or None where the file system has none (tmpfs)."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return None
    try:
        return os.open(path, os.O_RDONLY | o_direct | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def open_for_write(path: str | os.PathLike[str], *, direct: bool = True) -> tuple[int, bool]:
    """Create `path` exclusively (0644); O_DIRECT when asked and the file system takes it. The fd and whether direct."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            return os.open(path, flags | o_direct, 0o644), True
        except OSError:  # EINVAL: tmpfs and some others have no O_DIRECT
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return os.open(path, flags, 0o644), False


def write_state_file(
    path: str | os.PathLike[str], flat: FlatState, *, direct: bool = True, chunk: int = CHUNK
) -> list[Chunk]:
    """Write `flat` to a new file at `path`, fsync it; its chunks. Falls back to buffered I/O when O_DIRECT fails."""
    fd, is_direct = open_for_write(path, direct=direct)
    try:
        try:
            chunks = write_flat(fd, flat, chunk)
        except OSError:
            if not is_direct:
                raise
            os.close(fd)
            fd = -1
            os.unlink(path)
            fd, is_direct = open_for_write(path, direct=False)
            chunks = write_flat(fd, flat, chunk)
        os.fsync(fd)
        return chunks
    finally:
        if fd >= 0:
            os.close(fd)
