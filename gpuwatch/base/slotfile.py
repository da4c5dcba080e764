"""A small record rewritten in place, so it can still be written when its file system is full.

A full disk refuses new blocks, not writes into blocks a file already has. A SlotFile is written
out in full (zeros, not a sparse hole) when it is created, and every later write goes into one of
its two slots, alternately, with a sequence number and a CRC: a torn write leaves the other slot
intact, and reading takes the valid slot with the highest sequence. On file systems that copy on
write (btrfs, ZFS) an in-place write can still need space; a second copy on another file system
(Mirrored) covers that.

Slot layout: magic (4 bytes), sequence (8), payload length (4), CRC-32 of sequence, length and
payload (4), payload.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("gpuwatch.slotfile")

MAGIC = b"GWS1"
HEADER = struct.Struct("<4sQII")


class SlotFile:
    """One file of two slots of `slot_bytes` each, private to this user (0600, never through a symlink).

    Raises (from the constructor):
        OSError: the file cannot be created or written out in full (a full disk at creation).
    """

    def __init__(self, path: Path, slot_bytes: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.capacity = slot_bytes - HEADER.size
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600)
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise OSError(f"{path} is not a regular file of uid {os.geteuid()}")
            os.fchmod(self._fd, 0o600)
            self._fill(info.st_size)
        except OSError:
            os.close(self._fd)
            raise

    def _fill(self, size: int) -> None:
        """Write zeros up to the full size, so every later write lands in blocks the file owns."""
        want = 2 * self.slot_bytes
        while size < want:
            size += os.pwrite(self._fd, bytes(min(65536, want - size)), size)
        os.fsync(self._fd)

    def read(self) -> tuple[int, bytes] | None:
        """(sequence, payload) of the newest valid slot, or None when neither holds one."""
        best: tuple[int, bytes] | None = None
        for slot in (0, 1):
            raw = os.pread(self._fd, self.slot_bytes, slot * self.slot_bytes)
            if len(raw) < HEADER.size:
                continue
            magic, seq, length, crc = HEADER.unpack_from(raw)
            payload = raw[HEADER.size : HEADER.size + length]
            if magic != MAGIC or len(payload) != length or crc != _crc(seq, payload):
                continue
            if best is None or seq > best[0]:
                best = (seq, payload)
        return best

    def write(self, seq: int, payload: bytes) -> None:
        """Put `payload` in slot `seq % 2` (in the page cache: it survives the process, `sync` makes it survive
        a power cut).

        Raises:
            ValueError: `payload` does not fit a slot.
            OSError: the write or the sync failed.
        """
        if len(payload) > self.capacity:
            raise ValueError(f"{len(payload)} bytes do not fit a slot of {self.capacity}")
        record = HEADER.pack(MAGIC, seq, len(payload), _crc(seq, payload)) + payload
        os.pwrite(self._fd, record, (seq % 2) * self.slot_bytes)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class Mirrored:
    """The same record in several SlotFiles: written to each, read from the one written last.

    A copy that cannot be created or written is logged once and skipped; the record is lost only
    when no copy takes it.
    """

    def __init__(self, paths: Sequence[Path], slot_bytes: int, what: str) -> None:
        self.what = what
        self.copies: list[SlotFile] = []
        for path in paths:
            try:
                self.copies.append(SlotFile(path, slot_bytes))
            except OSError as exc:
                log.warning("%s: cannot keep a copy of %s here: %s", path, what, exc.strerror or exc)
        found = [got for got in (copy.read() for copy in self.copies) if got is not None]
        self.seq, self.payload = max(found, default=(0, b""), key=lambda got: got[0])
        self._failing: set[Path] = set()

    @property
    def capacity(self) -> int:
        return min((copy.capacity for copy in self.copies), default=0)

    def write(self, payload: bytes) -> bool:
        """Write `payload` to every copy; True when at least one took it."""
        self.seq += 1
        written = 0
        for copy in self.copies:
            try:
                copy.write(self.seq, payload)
            except (OSError, ValueError) as exc:
                if copy.path not in self._failing:
                    self._failing.add(copy.path)
                    log.error("%s: cannot write %s: %s", copy.path, self.what, getattr(exc, "strerror", None) or exc)
                continue
            self._failing.discard(copy.path)
            written += 1
        self.payload = payload
        return written > 0

    def sync(self) -> None:
        """Make the last write survive a power cut (each copy that can)."""
        for copy in self.copies:
            try:
                copy.sync()
            except OSError as exc:
                log.error("%s: cannot sync %s: %s", copy.path, self.what, exc.strerror or exc)

    def close(self) -> None:
        for copy in self.copies:
            copy.close()


def _crc(seq: int, payload: bytes) -> int:
    return zlib.crc32(struct.pack("<QI", seq, len(payload)) + payload)
