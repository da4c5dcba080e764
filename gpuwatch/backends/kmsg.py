"""The kernel log as a second XID source: the driver's `NVRM: Xid` lines (and NVSwitch `SXid` lines) in /dev/kmsg.

NVML delivers an XID only to an event set registered before it happened, so a fault at boot or
while the daemon was down is invisible to it; the kernel keeps the line. At start the buffer is
replayed (each XID dated by its kernel timestamp, so one older than every rule window is listed but
raises no alarm), then new lines are followed. A record of /dev/kmsg is `PRI,SEQ,USEC,FLAGS;TEXT`,
USEC being microseconds of the kernel's monotonic clock since boot; continuation lines start with a
space. A plain file or FIFO of such lines reads the same (tests). No access (a container, no
CAP_SYSLOG) is a state to log and export, not an error.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwatch.model import GpuEvent, GpuStatic

log = logging.getLogger("gpuwatch.kmsg")

# "NVRM: Xid (PCI:0000:18:00): 31, pid=1234, name=python3, Ch 00000008, ..."; the function digit is optional.
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?\): (\d+)")
# "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
_SXID = re.compile(r"SXid \(PCI:([0-9a-fA-F:.]+)\): (\d+)")
_PID = re.compile(r"\bpid=(\d{1,7})\b")  # '<unknown>' when the driver could not tell
_READ_SIZE = 8192  # a /dev/kmsg read returns one record and fails with EINVAL on a buffer too small for it


@dataclass(frozen=True)
class KernelXid:
    """One parsed driver line: `pci` is 'dddd:bb:dd' (the GPU's bus id without function), or the switch's for SXid."""

    t: float
    pci: str
    xid: int
    line: str
    sxid: bool = False
    pid: int | None = None  # the process whose work faulted, when the driver names one


def pci_key(bus_id: str) -> str:
    """'00000000:18:00.0' (NVML) and '0000:18:00' (the driver's log) both give '0000:18:00'."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) < 3:
        return bus_id.lower()
    domain, bus, device = parts[-3], parts[-2], parts[-1].split(".")[0]
    try:
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"
    except ValueError:
        return bus_id.lower()


def parse_record(record: str, boot_t: float) -> KernelXid | None:
    """The XID or SXid of one kmsg record, dated `boot_t` + its kernel timestamp; None for any other line."""
    header, sep, text = record.partition(";")
    if not sep or "Xid" not in text:
        return None
    fields = header.split(",")
    try:
        t = boot_t + int(fields[2]) / 1e6
    except (IndexError, ValueError):
        return None
    text = text.strip()
    if match := _XID.search(text):
        domain, bus, device, xid = match.groups()
        pid = _PID.search(text, match.end())
        return KernelXid(t, pci_key(f"{domain}:{bus}:{device}"), int(xid), text, pid=int(pid.group(1)) if pid else None)
    if match := _SXID.search(text):
        return KernelXid(t, pci_key(match.group(1)), int(match.group(2)), text, sxid=True)
    return None


def boot_time() -> float:
    """Wall time of the kernel's monotonic zero (kmsg timestamps count from it; suspend time is not counted)."""
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


class KernelLog:
    """Reads XIDs from a kmsg-format path and maps them to GPUs by PCI bus id.

    `readable` is None before open(), then whether the path could be opened. `sxids_total` counts
    NVSwitch lines (no GPU of ours: logged and counted only).
    """

    def __init__(self, path: str, statics: Iterable[GpuStatic], boot_t: float | None = None) -> None:
        self.path = path
        self.boot_t = boot_time() if boot_t is None else boot_t
        self._by_pci = {pci_key(s.pci_bus_id): s for s in statics if s.pci_bus_id}
        self._fd: int | None = None
        self._pending = b""
        self.readable: bool | None = None
        self.sxids_total = 0

    @property
    def gpus(self) -> frozenset[int]:
        """The indices of the GPUs whose XIDs this log can name (those with a known PCI bus id)."""
        return frozenset(static.index for static in self._by_pci.values())

    def open(self) -> bool:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            self.readable = False
            log.warning(
                "kernel log %s not readable (%s): XIDs from before the daemon started are not seen",
                self.path,
                exc.strerror or exc,
            )
            return False
        self.readable = True
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_available(self) -> list[GpuEvent]:
        """Every XID line readable now, without blocking, as events of our GPUs."""
        if self._fd is None:
            return []
        chunks = []
        while True:
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them: carry on with the next
                    continue
                log.warning("kernel log %s: read failed: %s", self.path, exc)
                break
            if not chunk:
                break
            chunks.append(chunk)
        if not chunks:
            return []
        data = self._pending + b"".join(chunks)
        *lines, self._pending = data.split(b"\n")
        return self._events(line.decode("utf-8", "replace") for line in lines)

    def _events(self, lines: Iterable[str]) -> list[GpuEvent]:
        events = []
        for line in lines:
            if not line or line.startswith(" "):
                continue
            parsed = parse_record(line, self.boot_t)
            if parsed is None:
                continue
            if parsed.sxid:
                self.sxids_total += 1
                log.warning("kernel log: NVSwitch %s", parsed.line)
                continue
            static = self._by_pci.get(parsed.pci)
            if static is None:
                log.info("kernel log: XID %d on PCI %s, not a GPU this daemon watches", parsed.xid, parsed.pci)
                continue
            events.append(
                GpuEvent(
                    parsed.t,
                    static.index,
                    static.uuid,
                    "xid",
                    parsed.xid,
                    source="kmsg",
                    detail=parsed.line,
                    pid=parsed.pid,
                )
            )
        return events

    def follow(self, stop: threading.Event, handle: Callable[[list[GpuEvent]], object], poll_s: float = 1.0) -> None:
        """Hand new XIDs to `handle` until `stop` is set (waits in select on /dev/kmsg, polls a plain file)."""
        while not stop.is_set() and self._fd is not None:
            try:
                ready, _, _ = select.select([self._fd], [], [], poll_s)
            except (OSError, ValueError):
                return  # closed under us
            events = self.read_available() if ready else []
            if events:
                handle(events)
            elif ready:
                stop.wait(poll_s)  # a plain file at its end is always "ready"
