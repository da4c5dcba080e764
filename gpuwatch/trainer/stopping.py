"""Whether a rank must stop and why, and when the link aborts a `rescue()` block that does not end.

Locking: none. Each field is one assignment that the signal handler, the link's thread or the
training thread makes; the request moves one way only (never reset), and `abort_due` reads each
field once, so a reader sees either the old or the new value of each, never a torn one.
"""

from __future__ import annotations

import time


class StopState:
    """The stop request, the term signal's arrival, and the rescue() block the main thread is in."""

    def __init__(self, abort_after_s: float) -> None:
        self.abort_after_s = abort_after_s
        self.requested = False
        self.reason: str | None = None
        self.stop_t: float | None = None  # monotonic time of the first stop request
        self.terminated = False  # the term signal arrived and no handler of the program's own takes it
        self.term_t: float | None = None  # monotonic time of the term signal
        self.block_entered_t: float | None = None  # monotonic; set while the main thread is inside rescue()
        self.aborted = False
        self.rescuing = False

    def request(self, reason: str) -> None:
        """Request a stop (first reason wins)."""
        if not self.requested:
            self.reason = reason
            self.stop_t = time.monotonic()
            self.requested = True

    def term_signal_arrived(self, *, program_handles_it: bool) -> None:
        """The term signal arrived: the rescue need not wait, and the loop ends unless the program takes it."""
        self.term_t = self.term_t or time.monotonic()
        self.terminated = not program_handles_it

    def polling(self) -> bool:
        """A stop is pending and nothing aborted or rescued yet: the thread looks for a rescue() block to time."""
        return self.stop_t is not None and not (self.aborted or self.rescuing)

    def abort_due(self) -> float | None:
        """When to abort: `abort_after_s` after the stop (or the block's start), at once after the term signal.

        The term signal means the group is being torn down (torchrun: a peer failed; the daemon: the
        grace period is over), so no step boundary is worth waiting for; the rescue is as good.
        """
        entered, stop_t = self.block_entered_t, self.stop_t
        if self.aborted or self.rescuing or entered is None or stop_t is None:
            return None
        if self.term_t is not None:
            return max(entered, self.term_t)
        return max(entered, stop_t) + self.abort_after_s
