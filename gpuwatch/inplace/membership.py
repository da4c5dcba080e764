"""A rank's view of its job's membership, pushed by the job's store: nothing is asked while nothing changes.

One thread per rank holds a long poll on the store (WATCH: "answer when `gen` is no longer the one I
know, or `done` is set"): the store answers it the moment the hosting launcher publishes a
generation, with the generation's delta in the same reply, and holds it otherwise (one request per
LONG_POLL_S per rank while nothing happens, instead of a `check` and a `get` every 20 ms). The
members' meeting before a generation's process group forms is one counter (`ready/<g>`): each
member adds 1 and waits, in one request, until it reaches the member count or a newer generation
comes.

Under a launcher that relays the generations to its node's ranks (gpuwatch.inplace.relay), the
thread reads the node's file instead, and the store holds one long poll per node, not per rank.

The rest of the rank (gpuwatch.inplace.job) reads `latest`, `done` and `generation(n)`, and waits
with `wait_newer` and `meet`; `on_new` is told each newer generation on the watcher's thread (the
NCCL abort when a peer is gone).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from gpuwatch.inplace.jobstore import GE, NE, READ, JobStore, encoded
from gpuwatch.inplace.protocol import DELTA, DONE, GEN, Generation, from_delta
from gpuwatch.inplace.relay import RELAY_POLL_S, file_key, read_relay

log = logging.getLogger("gpuwatch.inplace")

LONG_POLL_S = 300.0  # a long poll the store holds: answered at a change, asked again after this at the latest
_RETRY_S = 0.5  # after the store failed to answer (it may be gone at the job's end)
_KEEP = 8  # generations kept: the newest and a few before, to make the next from its delta


class Membership:
    """The generations of one job as this rank learns them (see the module docstring).

    Args:
        watch: a connection of its own, for the watcher thread's long poll.
        ask: the rank's connection for everything else (one request at a time, on the caller's thread).
        prefix: the job's key prefix (protocol.job_prefix), with its trailing "/".
        on_new: told the newer generation's number and record on the watcher's thread.
        relay: the node's membership file (its launcher's NodeRelay), read instead of a long poll.
    """

    def __init__(
        self,
        watch: JobStore,
        ask: JobStore,
        prefix: str,
        on_new: Callable[[Generation], None] | None = None,
        relay: str | None = None,
    ) -> None:
        self._watch, self._ask, self._prefix, self._on_new, self._relay = watch, ask, prefix, on_new, relay
        self._changed = threading.Condition()
        self._latest = 0
        self._done = False
        self._known: dict[int, Generation] = {}
        self._known_lock = threading.Lock()
        self._told = 0  # the newest generation on_new was told
        self._counted: set[int] = set()  # the generations this member counted itself in at
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpuwatch-inplace-membership", daemon=True)
        self._thread.start()

    @property
    def latest(self) -> int:
        """The newest generation's number the store told; 0 before the first."""
        return self._latest

    @property
    def done(self) -> bool:
        """A member finished: no generation comes any more."""
        return self._done

    def close(self) -> None:
        self._closed = True
        self._watch.close()  # the long poll ends at once
        with self._changed:
            self._changed.notify_all()

    def wait_newer(self, than: int, timeout_s: float) -> int:
        """The newest generation once it is newer than `than`, or the job is done, or timeout_s passed."""
        with self._changed:
            self._changed.wait_for(lambda: self._latest > than or self._done or self._closed, timeout_s)
            return self._latest

    def generation(self, number: int) -> Generation:
        """Generation `number`'s record: made from its delta when the one before is known, else read."""
        with self._known_lock:
            known = self._known.get(number)
        if known is not None:
            return known
        client = self._watch if threading.current_thread() is self._thread else self._ask
        record = Generation.from_json(client.get(self._key(f"gen/{number}")))
        self._keep(record)
        return record

    def meet(self, number: int, members: int, timeout_s: float, *, until_done: bool) -> bool:
        """Count this member in at generation `number`'s rendezvous; True once all `members` are in.

        False (without waiting longer) when a newer generation came, or when `until_done` and the
        job is done; the caller reads `latest` and `done` then.
        """
        key = self._key(f"ready/{number}")
        if number not in self._counted:
            self._counted.add(number)
            if self._ask.add(key, 1) >= members:
                return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            conditions = [(key, GE, str(members).encode()), (self._key(GEN), NE, encoded(str(number).encode()))]
            if until_done:
                conditions.append((self._key(DONE), NE, b""))
            values = self._ask.watch(conditions, min(LONG_POLL_S, max(0.001, deadline - time.monotonic())))
            if values[0] is not None and int(values[0]) >= members:
                return True
            newer = values[1] is not None and int(values[1]) > number
            done = until_done and values[2] is not None
            if newer or done:
                self._learn(int(values[1]) if newer and values[1] is not None else 0, None, done)
                return False
        return False

    # -- the watcher thread ---------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _run(self) -> None:
        if self._relay:
            self._follow(self._relay)
            return
        known_gen, known_done = b"", b""
        while not self._closed:
            try:
                gen, delta, done = self._watch.watch(
                    [(self._key(GEN), NE, known_gen), (self._key(DELTA), READ, b""), (self._key(DONE), NE, known_done)],
                    LONG_POLL_S,
                )
            except Exception as exc:  # the store may be gone at the job's end; training goes on
                if self._closed:
                    return
                log.debug("in-place membership watcher: %s", exc)
                time.sleep(_RETRY_S)
                continue
            known_gen, known_done = encoded(gen), encoded(done)
            self._learn(int(gen) if gen is not None else 0, delta, done is not None)

    def _follow(self, relay: str) -> None:
        """The node's file, looked at every RELAY_POLL_S (a stat) and read when its launcher replaced it."""
        seen = None
        while not self._closed:
            key = file_key(relay)
            if key is not None and key != seen:
                seen = key
                got = read_relay(relay)
                if got is not None:
                    self._learn(*got)
            time.sleep(RELAY_POLL_S)

    def _learn(self, number: int, delta: bytes | None, done: bool) -> None:
        """A newer generation (its delta when it came along) or the job's end: keep it, wake the waiters."""
        if number > self._latest and delta is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                with self._known_lock:
                    record = from_delta(delta, self._known.get(number - 1))
                if record is not None and record.number == number:
                    self._keep(record)
        with self._changed:
            self._latest = max(self._latest, number)
            self._done = self._done or done
            self._changed.notify_all()
        if number > self._told and self._on_new is not None and threading.current_thread() is self._thread:
            self._told = number
            try:
                self._on_new(self.generation(number))
            except Exception as exc:
                log.debug("in-place membership watcher: %s", exc)

    def _keep(self, record: Generation) -> None:
        with self._known_lock:
            self._known[record.number] = record
            for old in sorted(self._known)[:-_KEEP]:
                del self._known[old]
