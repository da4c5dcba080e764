"""Knowing at once that a rank's process ended: one pidfd per rank, all waited on by one poll().

A pidfd (Linux 5.3) becomes readable when its process exits, for any process, not only children,
so the remediation thread sleeps in poll() and wakes the moment a rank dies, at no cost while none
does. Where pidfd_open is missing or refused (old kernel, seccomp), the ranks are checked in /proc
every FALLBACK_POLL_S instead. A pipe wakes the poll when there is other work.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading

from gpuwatch.base.procfs import ProcFs

log = logging.getLogger("gpuwatch.remediation")

FALLBACK_POLL_S = 0.5


class ExitWatch:
    """Tells which watched processes exited since the last `wait()`; used by one thread only (but `wake`)."""

    def __init__(self, proc: ProcFs) -> None:
        self.proc = proc
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._wake_r, select.POLLIN)
        self._fds: dict[int, int] = {}  # pidfd → pid
        self._pids: dict[int, tuple[int | None, int | None]] = {}  # pid → (pidfd, start time)
        self._use_pidfd = hasattr(os, "pidfd_open")
        self._wake_lock = threading.Lock()  # a wake never writes to a closed (or reused) descriptor
        self._closed = False

    def __contains__(self, pid: int) -> bool:
        return pid in self._pids

    def add(self, pid: int, start_time: int | None) -> bool:
        """Watch `pid` (the process with that start time); False when it is already gone."""
        if pid in self._pids:
            return True
        fd = None
        if self._use_pidfd:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except OSError as exc:
                if exc.errno not in {errno.ENOSYS, errno.EPERM, errno.EACCES}:
                    raise
                log.warning(
                    "pidfd_open is not available (%s): checking ranks in /proc every %g s", exc, FALLBACK_POLL_S
                )
                self._use_pidfd = False
        if not self.proc.alive(pid, start_time):  # after the open: the pidfd is of this process, not a recycled pid
            if fd is not None:
                os.close(fd)
            return False
        if fd is not None:
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
        self._pids[pid] = (fd, start_time)
        return True

    def remove(self, pid: int) -> None:
        fd, _ = self._pids.pop(pid, (None, None))
        if fd is not None:
            self._poll.unregister(fd)
            del self._fds[fd]
            os.close(fd)

    def wake(self) -> None:
        """Make the current or next `wait()` return at once (any thread)."""
        with self._wake_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:
                pass  # already woken

    def wait(self, timeout_s: float) -> list[int]:
        """Sleep until a watched process exits, `wake()` or the timeout; the pids that exited (no longer watched)."""
        fallback = not self._use_pidfd and any(fd is None for fd, _ in self._pids.values())
        timeout_s = min(timeout_s, FALLBACK_POLL_S) if fallback else timeout_s
        ready = self._poll.poll(max(0, int(timeout_s * 1000)))
        exited = []
        for fd, _event in ready:
            if fd == self._wake_r:
                self._drain()
            elif fd in self._fds:
                exited.append(self._fds[fd])
        if fallback:
            exited += [pid for pid, (fd, start) in self._pids.items() if fd is None and not self.proc.alive(pid, start)]
        for pid in exited:
            self.remove(pid)
        return exited

    def close(self) -> None:
        """Release every descriptor; call once the waiting thread has ended."""
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
        for pid in list(self._pids):
            self.remove(pid)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
