"""The trainers' reports as the daemon holds them: one entry per rank process, in memory, bounded per user.

An entry is made when a rank connects to the report socket (gpuwatch.reports.server): the kernel
says which pid and uid connected (SO_PEERCRED), /proc says when that process started, so an entry
speaks for exactly one process and a recycled pid is a new entry. Its latest valid report and its
step page (the descriptor the rank passed) stay after the rank disconnects or dies, for
DEAD_KEEP_S after the process is gone, so remediation reads how a rank ended and its exact last
step. Every figure in a report is the rank's own word about its own process; which process and
which user it is are the kernel's.

Bounds: MAX_RANKS_PER_UID entries per uid, MAX_RANKS in all and MAX_CONNECTIONS_PER_PID (a user over
a bound is refused new connections, and only that user); reports are parsed as they arrive, so a read of the board
costs O(entries) in memory plus one pread per step page, never a directory scan.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from gpuwatch.base.procfs import ProcFs
from gpuwatch.base.sourcelog import SourceLog
from gpuwatch.model import TrainerInfo
from gpuwatch.reports.exit_notes import parse_exit_note
from gpuwatch.reports.parse import ReportError, parse_report
from gpuwatch.trainer.contract import REPORT_PROTOCOL, STEP_PAGE_BYTES, StepPage, read_step_page

log = logging.getLogger("gpuwatch.reports")

MAX_RANKS_PER_UID = 256
MAX_RANKS = 1024  # with each rank's connection and page: 3 fds each, under the unit's LimitNOFILE beside the API
MAX_CONNECTIONS_PER_PID = 2  # a rank needs one; a reconnect may overlap the old one's close
DEAD_KEEP_S = 30.0  # a gone process's entry is kept this long for remediation, then dropped
_GONE = -1  # the start time of a process that had ended when it connected


@dataclass(frozen=True)
class Report:
    """A validated report, the uid the kernel gave for its sender, and whether that process still runs."""

    info: TrainerInfo
    owner_uid: int
    alive: bool
    exit_t: float | None = None  # when its exit began, as its launcher (its parent) said: an exit note

    @property
    def running(self) -> bool:
        """The process runs and its link has not said how it ended."""
        return self.alive and self.info.ended is None


@dataclass
class _Entry:
    pid: int
    uid: int
    start_time: int
    exe: str | None = None  # what the process ran when it connected: after an exec it is not that rank
    info: TrainerInfo | None = None
    page_fd: int | None = None
    connected: int = 0  # connections of this process now open
    gone_mono: float | None = None  # when the process was first found gone
    parent: int | None = None  # its parent's pid when it connected: the only process whose exit note it takes
    exit_t: float | None = None  # when its exit began, from its parent's exit note


class ReportBoard:
    """The entries, keyed by pid; every method may be called from any thread."""

    def __init__(
        self,
        proc: ProcFs | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.proc = proc or ProcFs()
        self.clock = clock
        self.wall = wall  # the Unix time an exit note is checked against
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self.refused: Counter[str] = Counter()
        self._say = SourceLog(log)

    # -- what the socket server hands in -------------------------------------------------------

    def admit(self, pid: int, uid: int) -> int | None:
        """A connection from `pid` running as `uid`: the process's start time when it may report (its
        entry exists now), which binds the connection to that process; None when it is refused."""
        start_time = self.proc.start_time(pid)
        if start_time is None and self.proc.liveness(pid, None) is None:  # /proc unreadable: unknown, not gone
            with self._lock:
                return self._refused("unknown", uid, "pid %d (uid %d): /proc is unreadable now: refused", pid, uid)
        with self._lock:
            entry = self._entries.get(pid)
            if entry is not None and entry.start_time != start_time:
                self._drop(entry)  # the pid was recycled: the old process's entry goes
                entry = None
            if entry is None:
                if sum(1 for e in self._entries.values() if e.uid == uid) >= MAX_RANKS_PER_UID:
                    return self._refused(
                        "user_limit", uid, "uid %d has %d ranks here, the most one user may: pid %d refused",
                        uid, MAX_RANKS_PER_UID, pid,
                    )  # fmt: skip
                if len(self._entries) >= MAX_RANKS:
                    return self._refused("node_limit", uid, "%d ranks here, the most: pid %d refused", MAX_RANKS, pid)
                # Gone already (a short process's last words): kept as the report of a process that ended.
                entry = self._entries[pid] = _Entry(pid, uid, start_time if start_time is not None else _GONE)
                identity = self.proc.known_identity(pid)
                entry.exe = identity.exe if identity is not None else None
                entry.parent = self.proc.parent(pid)
            elif entry.connected >= MAX_CONNECTIONS_PER_PID:
                return self._refused("user_limit", uid, "pid %d (uid %d) is connected already", pid, uid)
            entry.connected += 1
            return entry.start_time

    def _admitted(self, pid: int, page_fd: int | None, start_time: int | None) -> _Entry | None:
        """An admitted connection's entry, with the step page it passed taken; None (the page closed) for any
        other, and for a connection of an earlier process that had the pid (`start_time` differs).
        Called with the lock held."""
        entry = self._entries.get(pid)
        if entry is None or (start_time is not None and entry.start_time != start_time):
            _close(page_fd)
            return None
        elif page_fd is not None:
            self._take_page(entry, page_fd)
        return entry

    def receive(self, pid: int, data: bytes, page_fd: int | None = None, start_time: int | None = None) -> bool:
        """A message of an admitted connection; a descriptor passed with it is taken or closed here.

        False when the connection speaks for no entry: its process (`start_time`, from `admit`) is not
        the one that has the pid now, or its entry was dropped. Close it then.
        """
        with self._lock:
            entry = self._admitted(pid, page_fd, start_time)
            if entry is None:
                return False
            try:
                entry.info = parse_report(data, pid)
            except ReportError as exc:
                self._refuse("invalid", entry.uid, "ignoring a report of pid %d (uid %d): %s", pid, entry.uid, exc)
            return True

    def exit_note(self, pid: int, data: bytes, start_time: int | None = None) -> bool:
        """An exit note (gpuwatch.reports.exit_notes) of an admitted connection: the time the exit of one of its
        children began, taken for that child only when this process is its parent (of the same user). A note
        of any other process, or out of bounds, changes nothing and is said in one line. False as `receive`."""
        with self._lock:
            sender = self._admitted(pid, None, start_time)
            if sender is None:
                return False
            try:
                child, t = parse_exit_note(data, self.wall())
            except ReportError as exc:
                uid = sender.uid
                self._refuse("invalid", uid, "ignoring an exit note of pid %d (uid %d): %s", pid, uid, exc)
                return True
            entry = self._entries.get(child)
            if entry is None or entry.parent != pid or entry.uid != sender.uid:
                self._refuse("invalid", sender.uid, "ignoring an exit note of pid %d (uid %d): pid %d is no rank it "
                             "started", pid, sender.uid, child)  # fmt: skip
                return True
            entry.exit_t = t
            return True

    def hello(self, pid: int, protocol: int, page_fd: int | None = None, start_time: int | None = None) -> bool:
        """A connection's first message: its hello naming `protocol` (1: none, an older rank), with the step page.

        False as `receive`."""
        with self._lock:
            entry = self._admitted(pid, page_fd, start_time)
            if entry is None:
                return False
            if protocol != REPORT_PROTOCOL:
                self._say.say(
                    entry.uid, logging.WARNING,
                    "pid %d (uid %d) speaks report protocol %d, this daemon %d%s: its reports are read as far as "
                    "this daemon understands them; install the same gpuwatch in the job and on the node",
                    pid, entry.uid, protocol, REPORT_PROTOCOL, " (it sent no hello)" if protocol == 1 else "",
                )  # fmt: skip
            return True

    def disconnected(self, pid: int, start_time: int | None = None) -> None:
        with self._lock:
            entry = self._entries.get(pid)
            if entry is not None and (start_time is None or entry.start_time == start_time):
                entry.connected = max(0, entry.connected - 1)

    def gone(self, pid: int, start_time: int) -> bool:
        """The process that connected (`pid` started at `start_time`) is certainly gone; unknown is not gone."""
        return start_time == _GONE or self.proc.liveness(pid, start_time) is False

    def refuse(self, reason: str, uid: int, message: str, *args: object, count: int = 1) -> None:
        """Count and say (rate-limited per uid) `count` refusals the server made itself (too large, too fast)."""
        with self._lock:
            self._refuse(reason, uid, message, *args, count=count)

    # -- readers --------------------------------------------------------------------------------

    def reports(self) -> list[Report]:
        """Every entry with a report, by pid; entries of processes gone for DEAD_KEEP_S are dropped."""
        now = self.clock()
        with self._lock:
            entries = list(self._entries.values())
        reports = []
        for entry in entries:
            alive = self._alive(entry)
            if not alive:
                with self._lock:
                    entry.gone_mono = entry.gone_mono if entry.gone_mono is not None else now
                    if now - entry.gone_mono > DEAD_KEEP_S:
                        self._drop(entry)
                        continue
            report = self._report(entry, alive)
            if report is not None:
                reports.append(report)
        return sorted(reports, key=lambda r: r.info.pid)

    def report(self, pid: int) -> Report | None:
        """The report of one pid (None when it never sent a valid one)."""
        with self._lock:
            entry = self._entries.get(pid)
        if entry is None:
            return None
        return self._report(entry, self._alive(entry))

    def connections(self) -> int:
        with self._lock:
            return sum(e.connected for e in self._entries.values())

    def close(self) -> None:
        with self._lock:
            for entry in list(self._entries.values()):
                self._drop(entry)

    # -- internals ------------------------------------------------------------------------------

    def _alive(self, entry: _Entry) -> bool:
        """The process that connected still runs the program it connected with (an exec ends the rank).

        A /proc that cannot be read now (the daemon out of descriptors) says nothing: alive, never gone.
        """
        if entry.start_time == _GONE or self.proc.liveness(entry.pid, entry.start_time) is False:
            return False
        if entry.exe is None:
            return True
        exe = self.proc.exe(entry.pid)  # one readlink: no file is opened
        return exe in (None, entry.exe)

    def _report(self, entry: _Entry, alive: bool) -> Report | None:
        info = entry.info
        if info is None:
            return None
        page = self._read_page(entry)
        changes: dict[str, object] = {"uid": entry.uid}  # one replace: a round makes one per rank
        if page is not None and page.step is not None and (info.step is None or page.step >= info.step):
            changes.update(
                step=page.step,
                step_t=page.step_t,
                first_step=page.first_step or info.first_step,
                first_step_t=page.first_step_t or info.first_step_t,
            )
        if page is not None and page.pause_until != info.pause_until:  # the page changes as a pause begins and ends
            changes.update(pause_until=page.pause_until, pause=info.pause or "a declared pause")
        return Report(replace(info, **changes), entry.uid, alive, entry.exit_t)  # type: ignore[arg-type]

    def _read_page(self, entry: _Entry) -> StepPage | None:
        fd = entry.page_fd
        if fd is None:
            return None
        try:
            return read_step_page(os.pread(fd, STEP_PAGE_BYTES, 0))
        except OSError:
            return None

    def _take_page(self, entry: _Entry, fd: int) -> None:
        """Keep the first step page a process passes, if it is a small regular file (or memfd) of its user."""
        try:
            st = os.fstat(fd)
        except OSError:
            return
        good = stat.S_ISREG(st.st_mode) and st.st_size >= STEP_PAGE_BYTES and st.st_uid == entry.uid
        if entry.page_fd is not None or not good:
            if not good:
                self._refuse("invalid", entry.uid, "pid %d (uid %d) passed no page of its own", entry.pid, entry.uid)
            _close(fd)
            return
        entry.page_fd = fd

    def _drop(self, entry: _Entry) -> None:
        self._entries.pop(entry.pid, None)
        _close(entry.page_fd)
        entry.page_fd = None

    def _refused(self, reason: str, uid: int, message: str, *args: object) -> int | None:
        """A refused connection, counted and said: None, what `admit` returns for it."""
        self._refuse(reason, uid, message, *args)
        return None

    def _refuse(self, reason: str, uid: int, message: str, *args: object, count: int = 1) -> bool:
        self.refused[reason] += count
        self._say.say(uid, logging.WARNING, message, *args)
        return False


def _close(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
