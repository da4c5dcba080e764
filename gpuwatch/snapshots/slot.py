"""One snapshot slot: a file in the job's shared-memory directory, a header, then a flat tensor file.

    [header: HEADER_LEN bytes][payload: the state as gpuwatch.trainer.tensorfile lays it out]

The header holds the slot's state, its step, the payload's size and the crc32 of each payload
chunk. A slot is rewritten in this order: state := WRITING; payload bytes; chunk crcs, step and the
header's own crc; state := COMMITTED. A rank that dies anywhere before the last store leaves a
slot whose state is not COMMITTED, and a reader never uses it (the two state values differ in every
byte, so even a torn 4-byte store is neither); a reader also re-checks every chunk's crc as it
copies the payload out, so bytes changed after the commit are caught too.

A slot is usable as soon as it is sized and mapped (map_sparse: milliseconds); `fill` then
allocates it (fallocate) and maps its pages in (so no snapshot pays the page faults), and `pin`
registers it with CUDA. Both walk every page, so they go in pieces (SETUP_PIECE, PIN_PIECE) with
the GIL released (mmap's MAP_POPULATE holds the GIL for the whole page walk, seconds per GiB, and
the training thread of the same process could not run a line of Python meanwhile), and after each
piece a pause as long as it took (a registration holds the CUDA driver's lock, which the job's CUDA
calls then get in between). No snapshot writes a CUDA state's slot before its set-up ends
(HostSnapshot); a CPU state's may (the fill changes no byte). A sparse
file written before its fill would kill the rank with SIGBUS if /dev/shm filled up: the set-up
checks the room for both slots first (prepare.py), and the fill's fallocate fails with ENOSPC.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import stat
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatch.trainer import tensorfile

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gpuwatch.snapshots")
_PIN_WARNED = False  # the pinning failure is said once per process

MAGIC = b"GWSNAP01"
VERSION = 1
WRITING = 0x57524954  # "WRIT"
COMMITTED = 0xC0FFEE11
_FIXED = struct.Struct("<8sIIqQQQQIIId")  # magic version state step seq payload data_off chunk n_chunks world rank t
_STATE_AT = 12  # byte offset of `state` in the header
_CRC = struct.Struct("<I")
HEADER_LEN = tensorfile.PAGE
_MAX_CHUNKS = (HEADER_LEN - _FIXED.size - _CRC.size) // _CRC.size
PIN_PIECE = 64 << 20  # registered with CUDA one piece at a time (see Slot._pin)
SETUP_PIECE = 8 << 20  # sized and populated one piece at a time (see Slot.ensure)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in, writable, without writing it


@dataclass(frozen=True)
class SlotHeader:
    """A committed slot's header: the step it holds and where its payload chunks are."""

    step: int
    seq: int
    payload_len: int
    data_off: int
    chunk: int
    world_size: int
    rank: int
    committed_t: float
    crcs: tuple[int, ...]

    def chunks(self) -> list[tensorfile.Chunk]:
        """The payload's chunks with their crcs (offsets relative to the payload)."""
        ranges = tensorfile.chunk_ranges(self.data_off, self.payload_len, self.chunk)
        return [tensorfile.Chunk(o, n, c) for (o, n), c in zip(ranges, self.crcs, strict=True)]


def chunk_size_for(payload_len: int) -> int:
    """16 MiB chunks (tensorfile.CHUNK), larger when the payload would need more chunks than the header holds."""
    size = tensorfile.CHUNK
    while payload_len // size + 2 > _MAX_CHUNKS:
        size *= 2
    return size


def read_header(fd: int) -> SlotHeader | None:
    """The header of the slot file `fd` when it is committed and its own crc matches, else None."""
    try:
        raw = os.pread(fd, HEADER_LEN, 0)
    except OSError:
        return None
    if len(raw) < HEADER_LEN:
        return None
    magic, version, state, step, seq, payload, data_off, chunk, n, world, rank, t = _FIXED.unpack_from(raw)
    if magic != MAGIC or version != VERSION or state != COMMITTED or not 0 < n <= _MAX_CHUNKS:
        return None
    crc_end = _FIXED.size + n * _CRC.size
    (stored,) = _CRC.unpack_from(raw, crc_end)
    if zlib.crc32(raw[:crc_end]) != stored:
        return None
    crcs = struct.unpack_from(f"<{n}I", raw, _FIXED.size)
    header = SlotHeader(step, seq, payload, data_off, chunk, world, rank, t, crcs)
    try:
        if tensorfile.chunk_count(data_off, payload, chunk) != n or os.fstat(fd).st_size < HEADER_LEN + payload:
            return None
    except (ValueError, OSError):
        return None
    return header


class Slot:
    """A slot file of ours, mapped read-write: where the snapshot copier puts a state, then commits it."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self.name = name
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        try:
            st = os.fstat(self.fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                raise OSError(f"slot {name} is not a regular file of ours")
            os.fchmod(self.fd, 0o600)
        except BaseException:
            os.close(self.fd)
            raise
        self.map: mmap.mmap | None = None
        self.size = 0
        self.payload_capacity = 0
        self._registered: list[int] = []  # the addresses of the pieces registered with CUDA (cudaHostRegister)
        self._payload: torch.Tensor | None = None  # the whole payload as one uint8 tensor (views of it are cheap)
        self._address: int | None = None  # the payload's address in this process while mapped
        self.map_s = 0.0  # of the last ensure(): sizing and mapping (the rest was pinning)
        self.pin_failed = False

    def header(self) -> SlotHeader | None:
        return read_header(self.fd)

    def ensure(self, payload_len: int, *, pin: bool, paced: bool = False) -> float:
        """Size the file for `payload_len` bytes (map_sparse, fill, pin); seconds it took (0 when already so).

        A file already of that size keeps its contents (a committed snapshot stays loadable until begin()).

        Raises:
            OSError: no room in the shared-memory file system (ENOSPC), or mapping failed.
        """
        pinned = bool(self._registered) or self.pin_failed
        if self.map is not None and payload_len <= self.payload_capacity and pin == pinned:
            return 0.0
        started = time.monotonic()
        self.map_sparse(payload_len)
        self.fill(paced=paced)
        if pin:
            self._pin()
        return time.monotonic() - started

    def map_sparse(self, payload_len: int) -> None:
        """Size the file (ftruncate: sparse) and map it: milliseconds, and writable at once (pages come on first
        touch). A file already of that size keeps its contents.

        Raises:
            OSError: mapping failed.
        """
        self.release()
        size = HEADER_LEN + tensorfile._align(payload_len, tensorfile.PAGE)
        if os.fstat(self.fd).st_size != size:  # a committed slot of the same size stays loadable until begin()
            self._invalidate_on_disk()
            os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)  # no MAP_POPULATE: it holds the GIL
        self.size, self.payload_capacity = size, size - HEADER_LEN

    def fill(self, *, paced: bool = False) -> None:
        """Allocate and populate the mapped file (the page walks: seconds per GiB), so no copy pays the faults.

        In SETUP_PIECE pieces with the GIL released; `paced` (a set-up off the training thread) also pauses
        after each piece as long as it took, so that the training thread gets the CPU and the process's
        memory map between pieces. A copy into the slot may run meanwhile: neither changes a byte of it.

        Raises:
            OSError: no room in the shared-memory file system (ENOSPC).
        """
        assert self.map is not None
        started = time.monotonic()
        for offset in range(0, self.size, SETUP_PIECE):
            _paced(paced, os.posix_fallocate, self.fd, offset, min(SETUP_PIECE, self.size - offset))
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        for offset in range(0, self.size, SETUP_PIECE):
            if not _paced(paced, _populate, base + offset, min(SETUP_PIECE, self.size - offset)):
                break  # a kernel without MADV_POPULATE_WRITE: the first snapshot pays the page faults
        self.map_s = time.monotonic() - started

    def allocated(self) -> int:
        """Bytes of the file already backed by memory (a sparse file's holes are not)."""
        return os.fstat(self.fd).st_blocks * 512

    def pin(self) -> float:
        """Register the mapping with CUDA when it is not yet (see _pin); seconds it took."""
        started = time.monotonic()
        if self.map is not None and not self._registered and not self.pin_failed:
            self._pin()
        return time.monotonic() - started

    def _invalidate_on_disk(self) -> None:
        with contextlib.suppress(OSError):
            if os.fstat(self.fd).st_size >= HEADER_LEN:
                os.pwrite(self.fd, struct.pack("<I", WRITING), _STATE_AT)

    def begin(self) -> None:
        """Mark the slot as being written: from here until commit() it is never loaded."""
        assert self.map is not None
        struct.pack_into("<I", self.map, _STATE_AT, WRITING)

    def payload_tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over payload bytes [offset, offset + nbytes) (pinned when the slot is)."""
        if self._payload is None:
            import torch

            assert self.map is not None
            self._payload = torch.frombuffer(
                self.map, dtype=torch.uint8, count=self.payload_capacity, offset=HEADER_LEN
            )
        return self._payload[offset : offset + nbytes]

    def payload_address(self) -> int:
        """The address of the payload's first byte in this process (for copies issued by address)."""
        if self._address is None:
            assert self.map is not None
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) + HEADER_LEN
        return self._address

    def spans(self, offset: int, length: int) -> list[tuple[int, int]]:
        """Payload [offset, offset + length) cut where one registered piece ends and the next begins.

        CUDA refuses a copy into host memory that crosses two registrations (invalid argument), so a
        device-to-host copy goes one span at a time.
        """
        if not self._registered:  # (one registered piece and the rest not, in the set-up window: cut too)
            return [(offset, length)] if length > 0 else []
        out = []
        end = offset + length
        while offset < end:
            piece_end = ((offset + HEADER_LEN) // PIN_PIECE + 1) * PIN_PIECE - HEADER_LEN
            cut = min(end, piece_end)
            out.append((offset, cut - offset))
            offset = cut
        return out

    def write_prefix(self, prefix: bytes) -> None:
        assert self.map is not None
        self.map[HEADER_LEN : HEADER_LEN + len(prefix)] = prefix

    def payload_view(self, length: int) -> memoryview:
        assert self.map is not None
        return memoryview(self.map)[HEADER_LEN : HEADER_LEN + length]

    def commit(self, *, step: int, seq: int, payload_len: int, data_off: int, chunk: int, crcs: list[int],
               world_size: int, rank: int, before_commit: Any = None) -> None:  # fmt: skip
        """Write the header with the chunk crcs, then (the last store) the COMMITTED state."""
        assert self.map is not None
        fixed = _FIXED.pack(MAGIC, VERSION, COMMITTED, step, seq, payload_len, data_off, chunk, len(crcs),
                            world_size, rank, time.time())  # fmt: skip
        body = fixed + struct.pack(f"<{len(crcs)}I", *crcs)
        body_with_writing = body[:_STATE_AT] + struct.pack("<I", WRITING) + body[_STATE_AT + 4 :]
        self.map[: len(body)] = body_with_writing
        _CRC.pack_into(self.map, len(body), zlib.crc32(body))
        if before_commit is not None:
            before_commit()
        struct.pack_into("<I", self.map, _STATE_AT, COMMITTED)
        with contextlib.suppress(OSError):
            os.utime(self.fd)  # the daemon's grace period counts from a job's last commit

    def invalidate(self) -> None:
        """Never load this slot again (a newer timeline replaced it)."""
        if self.map is not None:
            struct.pack_into("<I", self.map, _STATE_AT, WRITING)
        else:
            self._invalidate_on_disk()

    def _pin(self) -> None:
        """Page-lock the mapping for CUDA (cudaHostRegister), so device-to-host copies into it are DMA transfers.

        Registering walks every page (0.7 s for 16 GiB on an H200) and holds a driver lock the job's
        own CUDA calls wait on meanwhile: one call for the whole slot stalled a step by 0.8 s there.
        So it goes in PIN_PIECE pieces with a pause as long as each after it, and no step waits for
        more than one piece (a copy then goes piece by piece: `spans`). Where CUDA refuses (a file on
        a disk file system, a locked-memory limit, an old driver), the slot stays pageable: the
        copies still run, at about a quarter of the bandwidth. Said once in the log with CUDA's
        error, which is then cleared so that it does not surface in the job's next CUDA call.
        """
        torch = sys.modules.get("torch")
        if torch is None or self.map is None or not torch.cuda.is_available():
            return
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        address, code, reason = base, 0, "success"
        try:
            cudart = torch.cuda.cudart()
            for address in range(base, base + self.size, PIN_PIECE):
                started = time.monotonic()
                code = int(cudart.cudaHostRegister(address, min(PIN_PIECE, base + self.size - address), 0))
                if code != 0:
                    reason = _cuda_error(cudart, code)
                    break
                self._registered.append(address)
                time.sleep(time.monotonic() - started)  # the job's CUDA calls get the driver's lock in between
        except Exception as exc:  # no cudart binding in this torch build
            code, reason = -1, f"{type(exc).__name__}: {exc}"
        if code != 0:
            self._unpin()
            global _PIN_WARNED
            if not _PIN_WARNED:
                log.warning("slot %s: cudaHostRegister(%#x, %d bytes, 0) failed (%s): copies go unpinned",
                            self.name, address, min(PIN_PIECE, base + self.size - address), reason)  # fmt: skip
                _PIN_WARNED = True
            self.pin_failed = True

    def _unpin(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None:
            for address in self._registered:
                with contextlib.suppress(Exception):
                    torch.cuda.cudart().cudaHostUnregister(address)
        self._registered = []

    @property
    def pinned(self) -> bool:
        """Whether the mapping is registered with CUDA (page-locked)."""
        return bool(self._registered)

    def release(self) -> None:
        """Unpin and unmap (the file and its contents stay)."""
        self._unpin()
        self._payload, self._address = None, None
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a tensor view still alive: the map goes with it
                self.map.close()
        self.map = None
        self.payload_capacity = 0

    def close(self) -> None:
        self.release()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _paced(paced: bool, work: Any, *args: Any) -> Any:
    """work(*args); when paced, then a pause as long as it took (the training thread's turn)."""
    started = time.monotonic()
    result = work(*args)
    if paced:
        time.sleep(time.monotonic() - started)
    return result


_LIBC: list[Any] = []


def _populate(address: int, length: int) -> bool:
    """Fault [address, address + length) of a shared mapping in (madvise, GIL released); False where unsupported."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    libc = _LIBC[0]
    return libc is not None and libc.madvise(address, length, _MADV_POPULATE_WRITE) == 0


def _cuda_error(cudart: Any, code: int) -> str:
    """CUDA's name for error `code`; the error is read back (cudaGetLastError) so later calls do not see it."""
    if code == 0:
        return "success"
    with contextlib.suppress(Exception):
        cudart.cudaGetLastError()
    try:
        return f"CUDA error {code}: {cudart.cudaGetErrorString(cudart.cudaError(code))}"
    except Exception:  # a torch build without these bindings
        return f"CUDA error {code}"
