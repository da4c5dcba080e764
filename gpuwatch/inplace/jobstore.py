"""The job's store: what an in-place job's launchers and ranks share, and nobody else can reach.

torch's TCPStore takes every connection and answers every request (`list_keys` included), on every
interface: hosted there, the job's membership, its process groups' rendezvous and so a rank's place
were open to every user of the node. This store keeps torch's Store interface (the ranks' process
groups rendezvous through it under `pg/<g>/`, as before) with the data in a `dist.HashStore` inside
the hosting launcher, and a wire of its own in front of it:

* it listens only on the address it is given (loopback for a one-node job, the rendezvous
  endpoint's address for several nodes), never on every interface;
* before any request, each side proves that it holds the job's secret (HMAC-SHA256 over both sides'
  random nonces): a client without it reads the server's nonce and nothing else, and a client never
  sends a request to a server that has not proved it (an impostor on the endpoint's port);
* a connection that has not proved itself within HANDSHAKE_S is closed, and at most MAX_PENDING
  wait at once, so strangers cannot tie up the launcher.

After the handshake the connection is plain TCP: across nodes the network between the job's nodes
is trusted, as it is for gloo's and NCCL's own traffic.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Any

import torch.distributed as dist

HANDSHAKE_S = 5.0
MAX_PENDING = 32
MAX_FRAME = 64 << 20  # the store carries membership records and addresses, never the state
_MAGIC = b"GWIS1"
_NONCE = 32
_HEADER = struct.Struct("!I")

SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE, NUM_KEYS = range(1, 9)
_OK, _TIMEOUT, _ERROR = 0, 1, 2


class StoreAuthError(ConnectionError):
    """The other side did not prove that it holds the job's secret."""


def _mac(secret: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, who + first + second, hashlib.sha256).digest()


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
    body = _recv_exact(sock, size)
    fields, at = [], 1
    while at < size:
        if at + _HEADER.size > size:
            raise ConnectionError("a truncated field")
        (n,) = _HEADER.unpack_from(body, at)
        at += _HEADER.size
        if at + n > size:
            raise ConnectionError("a truncated field")
        fields.append(body[at : at + n])
        at += n
    return body[0], fields


class StoreServer:
    """The hosting launcher's store: `data` (a HashStore) served to clients that prove the secret."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        """Listen on host:port only (port 0: a free one).

        Raises:
            OSError: the address cannot be bound here (another node's, or taken).
        """
        self.data = dist.HashStore()
        self._secret = secret
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, port), family=family)
        self.port = int(self._listener.getsockname()[1])
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="gpuwatch-inplace-store", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            if not self._pending.acquire(blocking=False):
                conn.close()  # too many strangers at once: they wait for nothing here
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                proved = self._handshake(conn)
            except (OSError, ValueError):
                proved = False
            finally:
                self._pending.release()
            if not proved:
                return
            with self._lock:
                self._conns.add(conn)
            try:
                while True:
                    op, fields = _recv_frame(conn)
                    head, reply = self._answer(op, fields)
                    _send_frame(conn, head, reply)
            except (OSError, ValueError, IndexError):
                pass  # the client went away (or spoke out of turn: it is one of the job's, so a bug)
            finally:
                with self._lock:
                    self._conns.discard(conn)

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(HANDSHAKE_S)
        mine = os.urandom(_NONCE)
        conn.sendall(_MAGIC + mine)
        answer = _recv_exact(conn, 2 * _NONCE)
        theirs, proof = answer[:_NONCE], answer[_NONCE:]
        if not hmac.compare_digest(proof, _mac(self._secret, b"client", mine, theirs)):
            return False
        conn.sendall(_mac(self._secret, b"server", theirs, mine))
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True

    def _answer(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        data = self.data
        try:
            if op == SET:
                data.set(f[0].decode(), f[1])  # type: ignore[arg-type]  # bytes are taken as they are
                return _OK, []
            if op == GET:
                data.wait([f[0].decode()], datetime.timedelta(milliseconds=int(f[1])))
                return _OK, [data.get(f[0].decode())]
            if op == ADD:
                return _OK, [str(data.add(f[0].decode(), int(f[1]))).encode()]
            if op == CHECK:
                return _OK, [b"1" if data.check([k.decode() for k in f]) else b"0"]
            if op == WAIT:
                data.wait([k.decode() for k in f[1:]], datetime.timedelta(milliseconds=int(f[0])))
                return _OK, []
            if op == COMPARE_SET:
                return _OK, [data.compare_set(f[0].decode(), f[1], f[2])]  # type: ignore[arg-type]
            if op == DELETE:
                return _OK, [b"1" if data.delete_key(f[0].decode()) else b"0"]
            if op == NUM_KEYS:
                return _OK, [str(data.num_keys()).encode()]
        except dist.DistStoreError as exc:
            return _TIMEOUT, [str(exc).encode()]
        except (RuntimeError, ValueError, UnicodeDecodeError) as exc:
            return _ERROR, [str(exc).encode()]
        return _ERROR, [f"unknown request {op}".encode()]


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
    """Connect; prove the secret and have the server prove it too."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
        if not hello.startswith(_MAGIC):
            raise StoreAuthError(f"{host}:{port} is not an in-place job's store")
        theirs, mine = hello[len(_MAGIC) :], os.urandom(_NONCE)
        sock.sendall(mine + _mac(secret, b"client", theirs, mine))
        try:
            proof = _recv_exact(sock, _NONCE)
        except ConnectionError:
            raise StoreAuthError(f"the store at {host}:{port} refused this job's secret") from None
        if not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
            raise StoreAuthError(f"the store at {host}:{port} did not prove the job's secret")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    except BaseException:
        sock.close()
        raise


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _millis(seconds: float) -> bytes:
    return str(max(1, int(seconds * 1000))).encode()
