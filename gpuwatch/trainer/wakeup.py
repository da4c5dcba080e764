"""How a signal reaches the link's thread at once, even while the main thread is blocked in a collective.

A Python signal handler runs only when the main thread returns to bytecode, so the link also hands
each signal to `signal.set_wakeup_fd`: the C handler writes the signal number into this pipe from
whatever thread the kernel picked, and the link's thread, blocked in select() on the read end, sees
it at once. `step()` and `close()` write a 0 byte to wake the thread for other reasons.
Locking: none. Handlers are installed and put back on the main thread only; any thread (and the C
handler) may write the pipe, never blocking (a full pipe is awake already); only the link's thread reads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("gpuwatch.trainer")

WAKE = 0
"""The byte step() and close() write to the pipe; signal numbers are never 0."""

Handler = Callable[[int, FrameType | None], Any]


class SignalPipe:
    """The link's wake-up pipe and the signal handlers it replaced (stop and term signal, the fault drill's)."""

    def __init__(self, stop_signal: int | None, term_signal: int | None) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.owns_wakeup_fd = False
        self.previous: dict[int, Handler | int | None] = {}
        if stop_signal is None:  # the program handles signals itself
            term_signal = None
        self.stop_signals = {s for s in (stop_signal, term_signal) if s is not None}
        self.term_signal = term_signal

    def install(self, signums: set[int], handler: Handler) -> None:
        """Make `handler` take `signums` (the previous handlers are kept) and own the wakeup fd when free."""
        if not signums:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("TrainerLink created off the main thread: no signal handlers; status.json only")
            return
        for signum in sorted(signums):
            self.previous[signum] = signal.getsignal(signum)
            signal.signal(signum, handler)
        previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        if previous_fd == -1:
            self.owns_wakeup_fd = True
        else:  # asyncio or another library owns it: signals are then seen when the main thread runs Python
            signal.set_wakeup_fd(previous_fd)
            log.info("signal wakeup fd already in use: a rank blocked in a collective sees signals late")

    def chain(self, signum: int, frame: FrameType | None) -> None:
        """After the link's own handler: hand the signal to the thread if the C handler did not, run the previous."""
        if not self.owns_wakeup_fd:
            self.wake(signum)  # the C handler did not write it: hand it to the thread now
        previous = self.previous.get(signum)
        if callable(previous):  # SIG_DFL and SIG_IGN are ints, not callables
            previous(signum, frame)

    def restore(self, handler: Handler, *, exactly: bool = False) -> None:
        """Put the previous handlers back where `handler` is still installed (main thread only)."""
        if not self.previous:
            return
        if threading.current_thread() is not threading.main_thread():
            log.debug("TrainerLink closed off the main thread: signal handlers left in place")
            return
        if self.owns_wakeup_fd:
            current = signal.set_wakeup_fd(-1)
            if current != self.write_fd:  # replaced after we set it: put the newer owner's back
                signal.set_wakeup_fd(current)
            self.owns_wakeup_fd = False
        for signum, previous in self.previous.items():
            if signal.getsignal(signum) != handler:
                continue
            # None means a handler installed from C: it cannot be put back, so use the default.
            previous = previous if previous is not None else signal.SIG_DFL
            stop_only = signum in self.stop_signals and signum != self.term_signal
            if stop_only and previous == signal.SIG_DFL and not exactly:
                # A late stop request (the daemon does not know the loop is over) must not kill the
                # process in its epilogue (an evaluation, an upload): SIGUSR1's default action would.
                previous = signal.SIG_IGN
            signal.signal(signum, previous)
        self.previous.clear()

    def wake(self, byte: int = WAKE) -> None:
        """Wake the link's thread (with a signal number: hand it that signal)."""
        with contextlib.suppress(OSError):  # full (already awake) or closed
            os.write(self.write_fd, bytes([byte]))

    def wait(self, timeout: float) -> set[int] | None:
        """Sleep until `timeout` or a byte in the pipe: None when not woken, else the signals that arrived."""
        ready, _, _ = select.select([self.read_fd], [], [], timeout)
        if not ready:
            return None
        try:
            data = os.read(self.read_fd, 256)
        except BlockingIOError:
            return None
        return set(data) - {WAKE}

    def close(self) -> None:
        """Close the pipe, unless the C handler may still write to it (a number reused by another file)."""
        if self.owns_wakeup_fd:
            return
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
