"""The line protocol between the bench and its helper processes (the job, the NVML caller): one line each way.

The child answers with `answer`; the parent holds a `Child`: the process, its stderr in a file, and the
commands it sends, each waiting for its one line.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
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


class Child:
    """The parent's end of a helper: started with its stderr in `stderr_path`, asked one line at a time.

    Raises (from send and ask): RuntimeError naming `name`, and the last line of its stderr, when it
    exited or gave no answer in time.
    """

    def __init__(self, name: str, argv: Sequence[str], stderr_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self._stderr_path = stderr_path
        self._stderr = stderr_path.open("wb")
        self._process = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, line: str) -> None:
        stdin = self._process.stdin
        assert stdin is not None
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the {self.name} exited: {self.stderr_tail()}") from None

    def ask(self, line: str, timeout_s: float) -> str:
        """Send `line`; the one line answered, stripped."""
        self.send(line)
        stdout = self._process.stdout
        assert stdout is not None
        reply = read_line(stdout, timeout_s)
        if reply is None:
            state = "exited" if self._process.poll() is not None else f"gave no answer to {line.split()[0]}"
            raise RuntimeError(f"the {self.name} {state}: {self.stderr_tail()}")
        return reply.strip()

    def close(self) -> None:
        """Ask it to quit; kill it when it does not within 10 s."""
        if self._process.poll() is None:
            try:
                self.send("quit")
                self._process.wait(timeout=10)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        self._stderr.close()

    def stderr_tail(self) -> str:
        try:
            lines = [x for x in self._stderr_path.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "(no stderr)"
        return lines[-1] if lines else "(empty stderr)"
