"""The report socket: a SOCK_SEQPACKET Unix socket in the root-owned runtime dir, read by one thread.

Any local account may connect (the socket is 0666), so everything that arrives is untrusted; the
kernel vouches for who sent it (SO_PEERCRED at connect), and this module bounds what a sender
costs before a byte is parsed:

* a uid may connect ACCEPTS_PER_S times a second (burst ACCEPT_BURST), beyond that it is refused;
  the board refuses its MAX_RANKS_PER_UID-th rank and the node's MAX_RANKS-th;
* a connect storm costs the storming user: each wake-up drains the whole backlog (BACKLOG deep), a
  refused uid's connection is closed right after SO_PEERCRED (accept, getsockopt, close: nothing
  else, one count and one rate-limited line per uid per batch), and while a batch refused anyone
  the thread waits three times as long as the batch took before it accepts again: accepting takes
  at most STORM_CPU_SHARE of a core, and a storm up to what that share refuses (measured in the
  `connect storm` test) never fills the backlog, so other users' ranks connect on their first try;
* a connection may send MESSAGES_PER_S reports a second (burst MESSAGE_BURST): more are read and
  dropped unparsed, and a connection that keeps it up (FLOOD_DROPS in a row) is closed;
* a message over MAX_REPORT_BYTES is dropped (MSG_TRUNC), descriptors beyond the first are closed;
* a connection speaks for the process that made it, bound at connect by its pid and start time: it
  is closed within SWEEP_S once that process is gone (a connection handed to another process
  outlives its maker otherwise), and a message on it after the pid went to another process is
  never that process's; a uid holds at most MAX_CONNECTIONS_PER_UID connections;
* when accepting fails (EMFILE, ENFILE, ENOMEM), the thread backs off (up to ACCEPT_BACKOFF_MAX_S)
  and says so at most once per ACCEPT_LOG_S with a count, instead of spinning on the backlog.

Every connection taken is greeted with the daemon's hello (REPORT_PROTOCOL); a rank's first
message is its hello, and a rank that sends none (an older gpuwatch) or another version is named in
one line (per user, rate-limited) while its reports are read as before.

Readers call `poll()` before they read the board, so a report sent before a tick is in that tick,
and a rank's last report is read before anyone decides how it ended.
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.base.unixsock import address as socket_address
from gpuwatch.reports.board import MAX_RANKS_PER_UID, ReportBoard
from gpuwatch.trainer.contract import EXIT_NOTE_PREFIX, MAX_REPORT_BYTES, hello, hello_protocol

log = logging.getLogger("gpuwatch.reports")

ACCEPTS_PER_S = 20.0
ACCEPT_BURST = float(MAX_RANKS_PER_UID)  # a user's whole node of ranks starting together connects at once
BACKLOG = 4096  # listen(2)'s queue (the kernel caps it at net.core.somaxconn, 4096 by default)
STORM_CPU_SHARE = 0.25  # of one core, at most, spent accepting while a uid is refused for its connect rate
_ACCEPTS_PER_WAKE = BACKLOG
MAX_CONNECTIONS_PER_UID = 320  # a rank needs one (MAX_RANKS_PER_UID of them), a reconnect may overlap briefly
SWEEP_S = 1.0  # how often connections are checked for a process that is gone
ACCEPT_BACKOFF_MAX_S, ACCEPT_LOG_S = 1.0, 10.0
MESSAGES_PER_S, MESSAGE_BURST = 10.0, 20.0
FLOOD_DROPS = 200
_READS_PER_WAKE = 32  # messages read from one connection per wake-up: one sender cannot hold the thread
_MAX_FDS = 4
_HELLO = hello()
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class _Bucket:
    """A token bucket: `take()` is True while the rate (and the burst above it) is not exceeded."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class _Connection:
    sock: socket.socket
    pid: int
    start_time: int  # with the pid, the process that connected (ReportBoard.admit)
    uid: int
    bucket: _Bucket
    drops: int = 0
    greeted: bool = False  # its first message (a hello, or from an older rank a report) has come


class ReportServer:
    """Binds REPORT_SOCKET, accepts ranks and hands their messages to the board."""

    def __init__(self, path: Path, board: ReportBoard) -> None:
        self.path = path
        self.board = board
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._accepts: dict[int, _Bucket] = {}
        self._accept_after = 0.0  # monotonic time before which a storm's backlog is left alone
        self._per_uid: dict[int, int] = {}  # open connections per uid
        self._next_sweep = 0.0
        self._accept_backoff = 0.0
        self._accept_failures = 0  # since the last line that said so
        self._accept_said = -ACCEPT_LOG_S
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        """Create the socket (replacing a stale one of an earlier daemon), world-connectable.

        Raises:
            OSError: it cannot be created.
        """
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with socket_address(self.path) as address:
                listener.bind(address)
            os.chmod(self.path, 0o666)  # every local user's ranks report here; the kernel says who each is
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuwatch-reports", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """Take in whatever has arrived, now, without waiting."""
        if self._listener is None:
            return
        with self._lock:
            self._handle(self._selector.select(0))

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
            self._listener = None

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                pause = self._accept_after - time.monotonic()
                if pause > 0:
                    self._closed.wait(pause)  # a storm's pause; ranks' reports wait in their sockets meanwhile
                ready = self._selector.select(1.0)
                with self._lock:
                    if not self._closed.is_set():
                        self._handle(ready)
                        self._sweep()
            except Exception:  # one bad message must never end reporting for everyone
                log.exception("report socket: handling failed")
                self._closed.wait(1.0)

    def _handle(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        for key, _ in ready:
            if key.data is None:
                self._accept()
            else:
                self._read(key.data)

    def _accept(self) -> None:
        """Drain the backlog: refused uids' connections closed at once, the others admitted and read."""
        assert self._listener is not None
        if time.monotonic() < self._accept_after:
            return
        started = time.thread_time()  # this thread's CPU time: what the bound is about, not a busy machine's delays
        refused: dict[int, list[int]] = {}  # uid: [count, a pid]
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # EMFILE and the like: the backlog keeps the rest
                self._accept_failed(exc)
                break
            self._accept_backoff = 0.0
            pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            bucket = self._accepts.get(uid)
            if bucket is None:
                bucket = self._accepts[uid] = _Bucket(ACCEPTS_PER_S, ACCEPT_BURST)
                if len(self._accepts) > 4096:
                    self._accepts = {uid: bucket}
            if not bucket.take():
                sock.close()
                refused.setdefault(uid, [0, pid])[0] += 1
                continue
            if self._per_uid.get(uid, 0) >= MAX_CONNECTIONS_PER_UID:
                sock.close()
                self.board.refuse("user_limit", uid, "uid %d holds %d connections, the most: pid %d refused",
                                  uid, MAX_CONNECTIONS_PER_UID, pid)  # fmt: skip
                continue
            start_time = self.board.admit(pid, uid)
            if start_time is None:
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.send(_HELLO)  # the rank's receive queue is empty: this never blocks
            connection = _Connection(sock, pid, start_time, uid, _Bucket(MESSAGES_PER_S, MESSAGE_BURST))
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
            self._selector.register(sock, selectors.EVENT_READ, connection)
            self._read(connection)  # what it sent with its connect is in this very read
        for uid, (count, pid) in refused.items():
            self.board.refuse("rate", uid, "uid %d connects too often: %d connections refused (pid %d, ...)",
                              uid, count, pid, count=count)  # fmt: skip
        if refused:
            busy = time.thread_time() - started
            log.debug("report socket: %d refused in %.1f ms of CPU", sum(c for c, _ in refused.values()), busy * 1e3)
            self._accept_after = time.monotonic() + busy * (1.0 / STORM_CPU_SHARE - 1.0)

    def _read(self, connection: _Connection) -> None:
        for _ in range(_READS_PER_WAKE):
            try:
                data, ancillary, flags, _ = connection.sock.recvmsg(
                    MAX_REPORT_BYTES + 1, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in {errno.ECONNRESET, errno.EPIPE}:
                    log.debug("report socket: pid %d: %s", connection.pid, exc)
                self._disconnect(connection)
                return
            fds = _passed_fds(ancillary)
            if not data and not fds:
                self._disconnect(connection)
                return
            if not connection.bucket.take():
                _close_all(fds)
                connection.drops += 1
                if connection.drops >= FLOOD_DROPS:
                    self.board.refuse("rate", connection.uid, "pid %d floods the report socket: closed", connection.pid)
                    self._disconnect(connection)
                    return
                continue
            connection.drops = 0
            if flags & socket.MSG_TRUNC:
                self.board.refuse(
                    "too_large", connection.uid, "pid %d sent a report over %d bytes", connection.pid, MAX_REPORT_BYTES
                )
                _close_all(fds)
                continue
            _close_all(fds[1:])
            page, who = fds[0] if fds else None, (connection.pid, connection.start_time)
            if not connection.greeted:
                connection.greeted = True
                protocol = hello_protocol(data)
                if protocol is not None:  # the hello, with the step page
                    if not self.board.hello(who[0], protocol, page, who[1]):
                        self._disconnect(connection)
                        return
                    continue
                self.board.hello(who[0], 1, None, who[1])  # an older rank: its first report is what it sends first
            if data.startswith(EXIT_NOTE_PREFIX):  # a launcher dates its rank's exit (ReportBoard.exit_note)
                _close_all([page] if page is not None else [])
                if not self.board.exit_note(who[0], data, who[1]):
                    self._disconnect(connection)
                    return
                continue
            if not self.board.receive(who[0], data, page, who[1]):  # its process is not the pid's any more
                self._disconnect(connection)
                return

    def _disconnect(self, connection: _Connection) -> None:
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            return  # closed already
        connection.sock.close()
        self._per_uid[connection.uid] = max(0, self._per_uid.get(connection.uid, 0) - 1)
        if not self._per_uid[connection.uid]:
            del self._per_uid[connection.uid]
        self.board.disconnected(connection.pid, connection.start_time)

    def _sweep(self) -> None:
        """Close, at most every SWEEP_S, the connections whose process is gone (unknown is not gone), once
        what they queued is read."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        for key in list(self._selector.get_map().values()):
            connection = key.data
            if connection is not None and self.board.gone(connection.pid, connection.start_time):
                self._read(connection)  # its last words first: they were queued before it was gone
                if connection.sock.fileno() != -1:
                    self._disconnect(connection)

    def _accept_failed(self, exc: OSError) -> None:
        """Accepting failed: wait longer each time (the backlog keeps the connections), say so now and then."""
        self._accept_backoff = min(ACCEPT_BACKOFF_MAX_S, max(0.05, self._accept_backoff * 2))
        self._accept_after = time.monotonic() + self._accept_backoff
        self._accept_failures += 1
        if time.monotonic() - self._accept_said >= ACCEPT_LOG_S:
            log.warning(
                "report socket: accept failed %d time(s): %s; retrying in %.2f s",
                self._accept_failures, exc.strerror or exc, self._accept_backoff,
            )  # fmt: skip
            self._accept_said, self._accept_failures = time.monotonic(), 0


def _passed_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(array.array("i", data[:usable]))
    return fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
