"""The job's store: what an in-place job's launchers and ranks share, and nobody else can reach.

torch's TCPStore takes every connection and answers every request (`list_keys` included), on every
interface: hosted there, the job's membership, its process groups' rendezvous and so a rank's place
were open to every user of the node. This store keeps torch's Store interface (the ranks' process
groups rendezvous through it under `pg/<g>/`, as before) with the data in a table inside the
hosting launcher (`StoreServer.data`, itself a torch Store), and a wire of its own in front of it:

* it listens only on the address it is given (loopback for a one-node job, the rendezvous
  endpoint's address for several nodes), never on every interface;
* a connection from this node whose socket the kernel says belongs to another user is closed before
  a byte is sent (gpuwatch.inplace.peers), and so is a store of another user's to a client;
* the handshake (HMAC-SHA256 over both sides' random nonces): the client sends its nonce, the server
  proves that it holds the job's secret, and only then does the client prove it too. A process that
  squats the endpoint's port learns nothing it could test a guessed secret against offline;
* a connection that has not proved itself within HANDSHAKE_S of its accept is closed, and at most
  MAX_PENDING handshakes run at once: beyond that the store stops accepting until one ends (the
  others wait in the kernel's backlog, in order, rather than being turned away), so strangers cannot
  tie up the launcher and a thousand ranks starting at once are not refused.

One thread serves every connection (a selectors loop): a rank's long poll (WATCH: "tell me when
`gen` is no longer what I know") costs nothing while nothing changes, and a change is one reply to
each waiter. Counters (ADD) with a `ge` watch make a barrier of one key instead of one per rank.
After the handshake the connection is plain TCP: across nodes the network between the job's nodes
is trusted, as it is for gloo's and NCCL's own traffic.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import heapq
import hmac
import itertools
import logging
import os
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from gpuwatch.errors import InPlaceError
from gpuwatch.inplace.peers import socket_owner

log = logging.getLogger("gpuwatch.inplace.store")

HANDSHAKE_S = 5.0  # from accept to a proved client, in all
MAX_PENDING = 256
MAX_FRAME = 64 << 20  # the store carries membership records and addresses, never the state
_MAGIC = b"GWIS2"
_NONCE = 32
_HEADER = struct.Struct("!I")
_HELLO = len(_MAGIC) + _NONCE  # the client's first words
_GREETING = len(_MAGIC) + _NONCE + 32  # the server's answer: its nonce and its proof
_ACCEPTED = b"\x01"
_ACCEPT_PAUSE_S = 0.1  # after accept() fails (EMFILE): the loop goes on, accepting again after this

SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE, NUM_KEYS, WATCH = range(1, 10)
_OK, _TIMEOUT, _ERROR = 0, 1, 2
NE, GE, READ = b"ne", b"ge", b"rd"  # WATCH conditions: the value differs from; the counter reached; just read it


class StoreAuthError(InPlaceError, ConnectionError):
    """The other side did not prove that it holds the job's secret."""


def _mac(secret: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, who + first + second, hashlib.sha256).digest()


def encoded(value: bytes | None) -> bytes:
    """How WATCH tells a value: b"" for a key that is not set, b"=" and the value for one that is."""
    return b"" if value is None else b"=" + value


def decoded(field_: bytes) -> bytes | None:
    return field_[1:] if field_ else None


def raise_descriptor_limit() -> int:
    """The soft limit on open files raised to the hard one (a store holds a connection or two per rank)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


# -- the data -------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Waiter:
    """A request that waits: for keys to exist (GET, WAIT) or for a WATCH condition."""

    conn: _Conn | None
    op: int
    keys: list[str]
    conds: list[tuple[bytes, bytes]]  # WATCH only: (condition, argument) per key
    deadline: float
    done: bool = False


@dataclass
class _KeyWaiters:
    """Who waits on one key: by the value they know (NE), by the count they wait for (GE), for it to exist."""

    differs: dict[bytes, set[_Waiter]] = field(default_factory=dict)
    reaches: list[tuple[int, int, _Waiter]] = field(default_factory=list)  # a heap by target
    reaching: int = 0  # how many in `reaches` still wait (a finished one leaves the heap lazily)
    exists: set[_Waiter] = field(default_factory=set)

    def empty(self) -> bool:
        return not self.differs and not self.reaching and not self.exists


class LocalStore(dist.Store):
    """The table itself, a torch Store for the hosting launcher's own threads (no connection, no secret)."""

    def __init__(self, changed: Callable[[str], None]) -> None:
        super().__init__()
        self.values: dict[str, bytes] = {}
        self.lock = threading.Condition()
        self._waiting = 0  # the launcher's own threads in wait(): only then is a change notified
        self._changed = changed  # told every key that changed, with the lock held
        self._wait_default = datetime.timedelta(seconds=300)

    def put(self, key: str, value: bytes) -> None:
        with self.lock:
            self.values[key] = value
            self._after(key)

    def _after(self, key: str) -> None:
        if self._waiting:
            self.lock.notify_all()
        self._changed(key)

    def set(self, key: str, value: Any) -> None:
        self.put(key, _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self.lock:
            return self.values[key]

    def add(self, key: str, value: int) -> int:
        with self.lock:
            total = int(self.values.get(key, b"0")) + int(value)
            self.values[key] = str(total).encode()
            self._after(key)
            return total

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.values for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = (timeout or self._wait_default).total_seconds()
        with self.lock:
            self._waiting += 1
            try:
                found = self.lock.wait_for(lambda: all(k in self.values for k in keys), wait_s)
            finally:
                self._waiting -= 1
            if not found:
                raise dist.DistStoreError(f"the job's store: timed out waiting for {keys}")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        with self.lock:
            return self.compare_set_locked(key, _bytes(expected), _bytes(desired))

    def compare_set_locked(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's rule: set when the value is `expected` (or the key is missing and `expected` is empty)."""
        current = self.values.get(key)
        if (current is None and not expected) or current == expected:
            self.values[key] = desired
            self._after(key)
            return desired
        return expected if current is None else current

    def delete_key(self, key: str) -> bool:
        with self.lock:
            found = self.values.pop(key, None) is not None
            if found:
                self._after(key)
            return found

    def num_keys(self) -> int:
        with self.lock:
            return len(self.values)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._wait_default = timeout


# -- the server -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline: float  # the handshake's, from accept
    stage: int = 0  # 0: waiting for the hello, 1: for the proof, 2: proved
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    nonce: bytes = b""
    theirs: bytes = b""
    waiting: _Waiter | None = None
    closed: bool = False


class StoreServer:
    """The hosting launcher's store: `data` (a LocalStore) served to clients that prove the secret."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        """Listen on host:port only (port 0: a free one).

        Raises:
            OSError: the address cannot be bound here (another node's, or taken).
        """
        self.descriptors = raise_descriptor_limit()
        self._dirty: list[str] = []
        self._loop_thread: threading.Thread | None = None
        self.data = LocalStore(self._mark)
        self.requests = 0  # requests answered (the scale bench reads it)
        self.refused = 0  # connections closed before the greeting: another user's, or too many strangers
        self._secret = secret
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, port), family=family, backlog=4096)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: set[_Conn] = set()
        self._pending = 0
        self._accept_again = 0.0  # accepting paused after an error: again from then
        self._accepting = True
        self._waiters: dict[str, _KeyWaiters] = {}
        self._deadlines: list[tuple[float, int, Any]] = []  # (when, seq, _Waiter or _Conn): a heap
        self._seq = itertools.count()
        self._closed = threading.Event()
        self._last_error = 0.0
        self._loop_thread = threading.Thread(target=self._loop, name="gpuwatch-inplace-store", daemon=True)
        self._loop_thread.start()

    def close(self) -> None:
        self._closed.set()
        self._wake()
        if self._loop_thread is not None and self._loop_thread is not threading.current_thread():
            self._loop_thread.join(timeout=5)
        for conn in list(self._conns):
            self._drop(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    # -- the loop -------------------------------------------------------------------------------

    def _mark(self, key: str) -> None:
        """A key changed (the table's lock is held): its waiters are looked at by the loop."""
        self._dirty.append(key)
        if threading.current_thread() is not self._loop_thread:
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        """Serve until closed; an error in one connection closes that one, never the loop."""
        while not self._closed.is_set():
            try:
                self._turn()
            except Exception as exc:  # a bug must not stop the job's store: say it (at most once a second)
                self._say(f"the job's store goes on after {type(exc).__name__}: {exc}")
                time.sleep(0.01)

    def _turn(self) -> None:
        now = time.monotonic()
        wait = 1.0 if not self._deadlines else min(1.0, max(0.0, self._deadlines[0][0] - now))
        if self._accept_again:
            wait = min(wait, max(0.0, self._accept_again - now))
        if self._accept_again and now >= self._accept_again:
            self._accept_again = 0.0
            self._resume_accepting()
        for key, mask in self._selector.select(wait):
            what = key.data
            if what == "accept":
                self._accept()
            elif what == "wake":
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            else:
                try:
                    if mask & selectors.EVENT_READ:
                        self._read(what)
                    if mask & selectors.EVENT_WRITE and not what.closed:
                        self._flush(what)
                except (OSError, ValueError, IndexError, UnicodeDecodeError):
                    self._drop(what)
        self._settle()
        self._expire(time.monotonic())

    def _say(self, line: str) -> None:
        if time.monotonic() - self._last_error >= 1.0:
            self._last_error = time.monotonic()
            log.warning("%s", line)

    def _accept(self) -> None:
        for _ in range(256):  # a burst at a time: the loop serves the others between
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors (or memory): pause accepting, never stop
                self._say(f"the job's store cannot accept a connection: {exc}")
                self._accept_again = time.monotonic() + _ACCEPT_PAUSE_S
                self._pause_accepting()
                return
            if not self._own_user(sock):
                self.refused += 1
                sock.close()  # another user's: it gets nothing here
                continue
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + HANDSHAKE_S)
            self._pending += 1
            self._conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            heapq.heappush(self._deadlines, (conn.deadline, next(self._seq), conn))
            if self._pending >= MAX_PENDING:
                self._pause_accepting()  # the next wait in the backlog until a handshake ends
                return

    def _pause_accepting(self) -> None:
        if self._accepting:
            self._accepting = False
            self._selector.unregister(self._listener)

    def _resume_accepting(self) -> None:
        if not self._accepting and not self._accept_again and self._pending < MAX_PENDING:
            self._accepting = True
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")

    def _handshake_ended(self) -> None:
        self._pending -= 1
        self._resume_accepting()

    def _own_user(self, sock: socket.socket) -> bool:
        """False for a connection the kernel says another user's process made (from this node)."""
        owner = socket_owner(sock)
        return owner is None or owner == os.geteuid()

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.stage < 2:
            self._handshake_ended()
        if conn.waiting is not None:
            self._finish(conn.waiting)
        self._conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        chunk = conn.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed")
        conn.inbox += chunk
        if conn.stage < 2:
            self._handshake(conn)
        if conn.stage == 2:
            self._read_frames(conn)
        if len(conn.inbox) > MAX_FRAME + _HEADER.size:
            raise ValueError("a client sent more than one frame's worth before its answer")

    def _handshake(self, conn: _Conn) -> None:
        """The client's hello, then the server's proof, then the client's: see the module docstring."""
        if conn.stage == 0:
            if len(conn.inbox) < _HELLO:
                return
            if not conn.inbox.startswith(_MAGIC):
                raise ValueError("not a client of the job's store")
            conn.theirs = bytes(conn.inbox[len(_MAGIC) : _HELLO])
            del conn.inbox[:_HELLO]
            conn.nonce = os.urandom(_NONCE)
            conn.stage = 1
            self._send(conn, _MAGIC + conn.nonce + _mac(self._secret, b"server", conn.theirs, conn.nonce))
        if conn.stage == 1:
            if len(conn.inbox) < 32:
                return
            proof = bytes(conn.inbox[:32])
            del conn.inbox[:32]
            if not hmac.compare_digest(proof, _mac(self._secret, b"client", conn.nonce, conn.theirs)):
                raise ValueError("a wrong proof")
            conn.stage = 2
            self._handshake_ended()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._send(conn, _ACCEPTED)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if not conn.outbox:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            data = data[sent:]
            if not data:
                return
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        conn.outbox += data

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        del conn.outbox[:sent]
        if not conn.outbox:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _reply(self, conn: _Conn | None, head: int, fields: list[bytes]) -> None:
        if conn is None or conn.closed:
            return
        body = bytes([head]) + b"".join(_HEADER.pack(len(f)) + f for f in fields)
        self._send(conn, _HEADER.pack(len(body)) + body)

    # -- requests -------------------------------------------------------------------------------

    def _request(self, conn: _Conn, op: int, f: list[bytes]) -> None:
        table = self.data
        with table.lock:
            try:
                if op == SET:
                    table.values[f[0].decode()] = f[1]
                    table._after(f[0].decode())
                    self._reply(conn, _OK, [])
                elif op == ADD:
                    key, total = f[0].decode(), int(table.values.get(f[0].decode(), b"0")) + int(f[1])
                    table.values[key] = str(total).encode()
                    table._after(key)
                    self._reply(conn, _OK, [str(total).encode()])
                elif op == CHECK:
                    self._reply(conn, _OK, [b"1" if all(k.decode() in table.values for k in f) else b"0"])
                elif op == COMPARE_SET:
                    self._reply(conn, _OK, [table.compare_set_locked(f[0].decode(), f[1], f[2])])
                elif op == DELETE:
                    key = f[0].decode()
                    found = table.values.pop(key, None) is not None
                    if found:
                        table._after(key)
                    self._reply(conn, _OK, [b"1" if found else b"0"])
                elif op == NUM_KEYS:
                    self._reply(conn, _OK, [str(len(table.values)).encode()])
                elif op == GET:
                    self._park(_Waiter(conn, GET, [f[0].decode()], [], _deadline(f[1])))
                elif op == WAIT:
                    self._park(_Waiter(conn, WAIT, [k.decode() for k in f[1:]], [], _deadline(f[0])))
                elif op == WATCH:
                    keys = [k.decode() for k in f[1::3]]
                    conds = list(zip(f[2::3], f[3::3], strict=True))
                    if not keys or any(c not in (NE, GE, READ) for c, _ in conds):
                        raise ValueError("a WATCH without keys or with an unknown condition")
                    self._park(_Waiter(conn, WATCH, keys, conds, _deadline(f[0])))
                else:
                    self._reply(conn, _ERROR, [f"unknown request {op}".encode()])
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                self._reply(conn, _ERROR, [str(exc).encode()])

    def _ready(self, waiter: _Waiter) -> bool:
        values = self.data.values
        if waiter.op != WATCH:
            return all(k in values for k in waiter.keys)
        for key, (cond, arg) in zip(waiter.keys, waiter.conds, strict=True):
            value = values.get(key)
            if cond == NE and encoded(value) != arg:
                return True
            if cond == GE and value is not None and _is_count(value) and int(value) >= int(arg):
                return True
        return False

    def _answer(self, waiter: _Waiter, timed_out: bool) -> None:
        values = self.data.values
        if waiter.op == WATCH:
            self._reply(waiter.conn, _OK, [encoded(values.get(k)) for k in waiter.keys])
        elif timed_out:
            self._reply(waiter.conn, _TIMEOUT, [f"waited for {waiter.keys}".encode()])
        elif waiter.op == GET:
            self._reply(waiter.conn, _OK, [values[waiter.keys[0]]])
        else:
            self._reply(waiter.conn, _OK, [])

    def _park(self, waiter: _Waiter) -> None:
        """Answer now if it holds, else wait: indexed by key, so a change looks only at who waits for it."""
        if self._ready(waiter):
            self._answer(waiter, False)
            return
        assert waiter.conn is not None
        waiter.conn.waiting = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))
        values = self.data.values
        for index, key in enumerate(waiter.keys):
            slot = self._waiters.setdefault(key, _KeyWaiters())
            if waiter.op != WATCH:
                if key not in values:
                    slot.exists.add(waiter)
                    return  # the first missing key: the rest are looked at when it comes
                continue
            cond, arg = waiter.conds[index]
            if cond == NE:
                slot.differs.setdefault(arg, set()).add(waiter)
            elif cond == GE:
                heapq.heappush(slot.reaches, (int(arg), next(self._seq), waiter))
                slot.reaching += 1

    def _finish(self, waiter: _Waiter) -> None:
        waiter.done = True
        if waiter.conn is not None:
            waiter.conn.waiting = None
        for index, key in enumerate(waiter.keys):
            slot = self._waiters.get(key)
            if slot is None:
                continue
            slot.exists.discard(waiter)
            cond, arg = waiter.conds[index] if waiter.op == WATCH else (b"", b"")
            if cond == NE:
                group = slot.differs.get(arg)
                if group is not None:
                    group.discard(waiter)
                    if not group:
                        del slot.differs[arg]
            elif cond == GE:
                slot.reaching -= 1
            if slot.empty():
                del self._waiters[key]

    def _settle(self) -> None:
        """Answer the waiters whose keys changed since the last turn."""
        with self.data.lock:
            dirty, self._dirty = self._dirty, []
            values = self.data.values
            for key in dict.fromkeys(dirty):
                slot = self._waiters.get(key)
                if slot is None:
                    continue
                value = values.get(key)
                woken: list[_Waiter] = []
                if value is not None:
                    woken.extend(slot.exists)
                now = encoded(value)
                woken.extend(w for known, group in slot.differs.items() if known != now for w in group)
                if value is not None and slot.reaches and _is_count(value):
                    count = int(value)
                    while slot.reaches and (slot.reaches[0][2].done or slot.reaches[0][0] <= count):
                        woken.append(heapq.heappop(slot.reaches)[2])
                for waiter in woken:
                    if waiter.done:
                        continue
                    conn = waiter.conn
                    self._finish(waiter)
                    if waiter.op == WAIT or waiter.op == GET:
                        if not self._ready(waiter):  # another key still missing: wait for it
                            waiter.done = False
                            self._park(waiter)
                            continue
                    self._answer(waiter, False)
                    if conn is not None and not conn.closed and conn.inbox:
                        self._read_buffered(conn)

    def _read_buffered(self, conn: _Conn) -> None:
        """A frame that came while its connection's request waited (a client pipelining): serve it now."""
        try:
            self._read_frames(conn)
        except (OSError, ValueError, IndexError, UnicodeDecodeError):
            self._drop(conn)

    def _read_frames(self, conn: _Conn) -> None:
        while conn.waiting is None and len(conn.inbox) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(conn.inbox)
            if not 1 <= size <= MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes")
            if len(conn.inbox) < _HEADER.size + size:
                return
            body = bytes(conn.inbox[_HEADER.size : _HEADER.size + size])
            del conn.inbox[: _HEADER.size + size]
            op, fields = _parse(body)
            self.requests += 1
            self._request(conn, op, fields)

    def _expire(self, now: float) -> None:
        """Close handshakes past their deadline; answer waits past theirs."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, what = heapq.heappop(self._deadlines)
            if isinstance(what, _Conn):
                if what.stage < 2 and not what.closed:
                    self._drop(what)
            elif not what.done:
                with self.data.lock:
                    self._finish(what)
                    self._answer(what, True)


def _is_count(value: bytes) -> bool:
    """A counter's value (what ADD writes); a GE watch on anything else never holds."""
    return value.lstrip(b"-").isdigit()


def _parse(body: bytes) -> tuple[int, list[bytes]]:
    fields, at, size = [], 1, len(body)
    while at < size:
        if at + _HEADER.size > size:
            raise ValueError("a truncated field")
        (n,) = _HEADER.unpack_from(body, at)
        at += _HEADER.size
        if at + n > size:
            raise ValueError("a truncated field")
        fields.append(body[at : at + n])
        at += n
    return body[0], fields


def _deadline(millis: bytes) -> float:
    return time.monotonic() + max(1, int(millis)) / 1000


# -- the client -----------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send_frame(sock: socket.socket, head: int, fields: list[bytes]) -> None:
    body = bytes([head]) + b"".join(_HEADER.pack(len(f)) + f for f in fields)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if not 1 <= size <= MAX_FRAME:
        raise ConnectionError(f"a frame of {size} bytes")
    try:
        return _parse(_recv_exact(sock, size))
    except ValueError as exc:
        raise ConnectionError(str(exc)) from None


class JobStore(dist.Store):
    """A client of the job's StoreServer, usable wherever torch takes a Store (PrefixStore, process groups).

    Raises (from the constructor):
        StoreAuthError: the server did not prove the job's secret (or this client's proof was refused).
        OSError: nothing answers at host:port.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: datetime.timedelta) -> None:
        super().__init__()
        self._where = (host, port, secret, timeout)
        self._clones: list[JobStore] = []
        self._timeout_s = timeout.total_seconds()
        self._lock = threading.Lock()  # one request at a time: torch may call from several threads
        self._sock = _connect(host, port, secret, min(self._timeout_s, 30.0))

    def _ask(self, op: int, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            try:
                self._sock.settimeout(wait_s + self._timeout_s)
                _send_frame(self._sock, op, fields)
                head, reply = _recv_frame(self._sock)
            except OSError as exc:
                raise dist.DistStoreError(f"the job's store: {exc}") from None
        if head == _TIMEOUT:
            raise dist.DistStoreError(f"the job's store: timed out: {reply[0].decode(errors='replace')}")
        if head != _OK:
            raise dist.DistStoreError(f"the job's store: {reply[0].decode(errors='replace') if reply else head}")
        return reply

    def set(self, key: str, value: Any) -> None:
        self._ask(SET, [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        return self._ask(GET, [key.encode(), _millis(self._timeout_s)], self._timeout_s)[0]

    def add(self, key: str, value: int) -> int:
        return int(self._ask(ADD, [key.encode(), str(int(value)).encode()])[0])

    def check(self, keys: list[str]) -> bool:
        return self._ask(CHECK, [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        self._ask(WAIT, [_millis(wait_s), *(k.encode() for k in keys)], wait_s)

    def watch(self, conditions: list[tuple[str, bytes, bytes]], timeout_s: float) -> list[bytes | None]:
        """Wait (at most timeout_s) until one condition holds; every key's value then (None: not set).

        A condition is (key, NE, encoded(known)): the value is no longer `known`; (key, GE, b"<n>"):
        the counter reached n; (key, READ, b""): only read it along.
        """
        fields = [_millis(timeout_s)]
        for key, cond, arg in conditions:
            fields += [key.encode(), cond, arg]
        return [decoded(v) for v in self._ask(WATCH, fields, timeout_s)]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._ask(COMPARE_SET, [key.encode(), _bytes(expected), _bytes(desired)])[0]

    def delete_key(self, key: str) -> bool:
        return self._ask(DELETE, [key.encode()])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._ask(NUM_KEYS, [])[0])

    def clone(self) -> JobStore:
        """A connection of its own to the same store (torch clones a store for a split process group)."""
        clone = JobStore(*self._where)
        self._clones.append(clone)  # a Python store only torch holds loses its methods
        return clone

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


def _connect(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    """_prove, tried again while the server is busy with strangers (it closes before its greeting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _prove(host, port, secret, timeout_s)
        except StoreAuthError:
            raise
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _prove(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    """Connect; have the server prove the secret first, then prove it too (see the module docstring)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    where = f"{host}:{port}"
    try:
        owner = socket_owner(sock)
        if owner is not None and owner != os.geteuid():
            raise StoreAuthError(f"{where} is another user's (uid {owner}), not this job's store")
        mine = os.urandom(_NONCE)
        sock.sendall(_MAGIC + mine)
        try:
            greeting = _recv_exact(sock, _GREETING)
        except ConnectionError:
            raise ConnectionError(f"{where} closed before its greeting (busy, or not this job's store)") from None
        if not greeting.startswith(_MAGIC):
            raise StoreAuthError(f"{where} is not an in-place job's store (or one of another gpuwatch version)")
        theirs, proof = greeting[len(_MAGIC) : len(_MAGIC) + _NONCE], greeting[len(_MAGIC) + _NONCE :]
        if not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
            raise StoreAuthError(f"the store at {where} did not prove this job's secret: another job's, or an impostor")
        sock.sendall(_mac(secret, b"client", theirs, mine))
        try:
            _recv_exact(sock, len(_ACCEPTED))
        except ConnectionError:
            raise StoreAuthError(f"the store at {where} refused this client's proof") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except BaseException:
        sock.close()
        raise


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _millis(seconds: float) -> bytes:
    return str(max(1, int(seconds * 1000))).encode()
