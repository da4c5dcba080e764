"""One watcher of the job's store per node: the launcher relays each generation to its node's ranks.

The job's store then holds one long poll per node, not one per rank, and a membership change is one
push per node. The launcher's NodeRelay writes the newest generation's number, its delta and
whether the job is done to a file in a directory only its user can enter (0700, the file replaced
whole, never written in place); its ranks look at the file's identity every RELAY_POLL_S (a stat,
no store request) and read it when it changed. A rank checks that the file is its own user's and
that nobody else can write it, as it does for the secret file; the job's other keys (the meeting,
the process groups' rendezvous) it still reads from the store itself.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

from gpuwatch.inplace.jobstore import NE, READ, JobStore, encoded
from gpuwatch.inplace.protocol import DELTA, DONE, GEN

log = logging.getLogger("gpuwatch.inplace")

RELAY_ENV = "GPUWATCH_INPLACE_RELAY"  # the node's membership file, for its ranks
RELAY_POLL_S = 0.02  # how often a rank looks at the file's identity
LONG_POLL_S = 300.0
_MAX_FILE = 1 << 20


class NodeRelay:
    """The node's watcher: a long poll on the job's store, each answer written to `path` for the ranks."""

    def __init__(self, client: JobStore, prefix: str) -> None:
        self._client, self._prefix = client, prefix
        self.directory = Path(tempfile.mkdtemp(prefix="gpuwatch-relay-"))  # 0700
        self.path = self.directory / "membership"
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpuwatch-inplace-relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._client.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self) -> None:
        known_gen, known_done = b"", b""
        gen_key, delta_key, done_key = (self._prefix + name for name in (GEN, DELTA, DONE))
        while not self._closed:
            try:
                gen, delta, done = self._client.watch(
                    [(gen_key, NE, known_gen), (delta_key, READ, b""), (done_key, NE, known_done)], LONG_POLL_S
                )
            except Exception as exc:  # the store may be gone at the job's end
                if self._closed:
                    return
                log.debug("in-place relay: %s", exc)
                time.sleep(0.5)
                continue
            known_gen, known_done = encoded(gen), encoded(done)
            body = {"gen": int(gen) if gen else 0, "delta": delta.decode() if delta else None, "done": done is not None}
            with contextlib.suppress(OSError):
                self._write(json.dumps(body).encode())

    def _write(self, data: bytes) -> None:
        """The whole file replaced at once: a rank never reads half of it."""
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".membership-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, self.path)


def file_key(path: str) -> tuple[int, int, int] | None:
    """What changes when the relay replaces the file: its inode, size and mtime; None when it is not there."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def read_relay(path: str) -> tuple[int, bytes | None, bool] | None:
    """(generation, its delta, done) from the node's file; None when it is not there yet or not trustworthy."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            log.warning("in-place relay file %s is not this user's own: ignored", path)
            return None
        raw = file.read(_MAX_FILE)
    try:
        body = json.loads(raw)
        delta = body["delta"]
        return int(body["gen"]), (delta.encode() if isinstance(delta, str) else None), bool(body["done"])
    except (ValueError, KeyError, TypeError):
        return None


def node_relay(address: str, secret: bytes, prefix: str) -> NodeRelay | None:
    """The node's relay on a connection of its own to the job's store at `address`; None (the ranks then
    watch the store themselves) when it cannot connect."""
    host, _, port = address.rpartition(":")
    try:
        client = JobStore(host, int(port), secret, datetime.timedelta(seconds=600))
    except (OSError, ValueError) as exc:
        log.warning("in-place relay: the job's store at %s: %s: each rank watches it itself", address, exc)
        return None
    return NodeRelay(client, f"{prefix}/")
