"""The line protocol between the bench and its helper processes (the job, the NVML caller): one line each way."""

from __future__ import annotations

import selectors
import sys
from typing import IO


def answer(line: str) -> None:
    """The child's answer to the parent: one line on stdout, flushed at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_line(stream: IO[str], timeout_s: float) -> str | None:
    """The parent's read of one answer from a child's pipe: None at its end or after `timeout_s`.

    The protocol answers each command with one line, so nothing is left in the stream's buffer that
    the selector would not see.
    """
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return None
    line = stream.readline()
    return line or None
