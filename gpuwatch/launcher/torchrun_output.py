"""torchrun's output, sorted for the person at the terminal: all of it to a log file, the job's own lines to stderr.

torchrun runs with `--tee 2`, so each worker's stderr reaches ours prefixed `[default<local rank>]:` (its
stdout is the job's own and passes untouched). Lines without that prefix are torchrun's own: its banner,
its log lines as it tears a job down, and the ChildFailedError traceback it raises when a worker fails,
which buries the cause under 40 lines. Those go to the log file only; when the run ends, launch says in
one line per failed rank what happened (`failure_lines`), with that rank's own last error line and the
log file's path.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from gpuwatch.trainer.contract import EXIT_RESUME

TEE_ARGS = ("--tee", "2")  # workers' stderr to torchrun's, prefixed, and to per-rank files under --log-dir
_WORKER_LINE = re.compile(rb"^\[[^\]\d]+(\d+)\]:")  # [default0]: (its role, its local rank); not the summary's [0]:
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Fault|Interrupt)\b|\berror\b|\bfailed\b", re.IGNORECASE)
_TAIL_BYTES = 64 * 1024
_TRACEBACK = "Traceback (most recent call last):"


@dataclass(frozen=True)
class Failure:
    """One failed worker as torchrun's closing summary lists it."""

    rank: int
    local_rank: int
    exitcode: int  # negative: killed by that signal
    pid: int | None = None

    def how(self) -> str:
        """ "killed by SIGKILL" or "exited 7"."""
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exited {self.exitcode}"


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_ROOT_HEADER = "Root Cause (first observed failure):"


def parse_failures(torchrun_tail: str) -> tuple[Failure, ...]:
    """The failed workers of torchrun's last summary (ChildFailedError), root cause first; () when none."""
    root_at = torchrun_tail.rfind(_ROOT_HEADER)
    if root_at < 0:
        return ()
    others_at = torchrun_tail.rfind("Failures:", 0, root_at)
    sections = (torchrun_tail[root_at:], torchrun_tail[others_at:root_at] if others_at >= 0 else "")
    return tuple(
        Failure(int(rank), int(local_rank), int(code), int(pid))
        for section in sections
        for rank, local_rank, code, pid in _FAILURE.findall(section)
    )


class TorchrunOutput:
    """Sorts torchrun's stderr as it comes (`feed`): everything to `log`, workers' lines on to `terminal`.

    Keeps the tail of torchrun's own lines (for its summary, `failures`) and each worker's last error line.
    """

    def __init__(self, log: BinaryIO, terminal: BinaryIO | None = None) -> None:
        self.log = log
        self.terminal = terminal
        self.own_tail = bytearray()  # torchrun's own lines, the last _TAIL_BYTES
        self.last_error: dict[int, str] = {}  # local rank → its last error line
        self._in_traceback: set[int] = set()  # local ranks whose traceback's frames are coming
        self._partial = b""

    def feed(self, chunk: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.log.write(chunk)
            self.log.flush()
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        shown = [line for line in lines if self._sort(line)]
        if shown:
            _write(self.terminal, b"".join(line + b"\n" for line in shown))

    def finish(self) -> None:
        """The last line, when torchrun ended without a newline."""
        if self._partial:
            partial, self._partial = self._partial, b""
            if self._sort(partial):
                _write(self.terminal, partial + b"\n")

    def _sort(self, line: bytes) -> bool:
        """Note the line; True when it is a worker's (shown), False when it is torchrun's own (logged only)."""
        worker = _WORKER_LINE.match(line)
        if worker is None:
            self.own_tail += line + b"\n"
            del self.own_tail[:-_TAIL_BYTES]
            return False
        raw = line[worker.end() :].decode(errors="replace")
        text, rank = raw.strip(), int(worker.group(1))
        if rank in self._in_traceback and text and not raw[:1].isspace():
            self._in_traceback.discard(rank)  # the first line after the frames: the exception, whatever its name
            self.last_error[rank] = text[:300]
        elif text.startswith(_TRACEBACK):
            self._in_traceback.add(rank)
        elif _ERROR_LINE.search(text):
            self.last_error[rank] = text[:300]
        return True

    def failures(self) -> tuple[Failure, ...]:
        return parse_failures(bytes(self.own_tail).decode(errors="replace"))

    def own_error(self) -> str:
        """torchrun's own last error line (a rendezvous that failed, a bad option), or ""."""
        lines = bytes(self.own_tail).decode(errors="replace").splitlines()
        return next((line.strip()[:300] for line in reversed(lines) if _ERROR_LINE.search(line)), "")


def failure_lines(failures: Sequence[Failure], last_error: dict[int, str], log_path: str, command: str) -> list[str]:
    """One line per failed rank. A stop for resume says so; a crash names the rank's own last error line and the
    log. Ranks torchrun tore down because a peer failed are named only when nothing else failed."""
    torn_down = -signal.SIGTERM
    planned = any(f.exitcode == EXIT_RESUME for f in failures) and all(
        f.exitcode in (EXIT_RESUME, torn_down) for f in failures
    )
    if planned:
        why = {EXIT_RESUME: "stopped for resume", torn_down: "stopped by torchrun once a peer had stopped"}
        return [
            f"{command}: rank {f.rank} (local rank {f.local_rank}, pid {f.pid}) {f.how()}: {why[f.exitcode]}"
            for f in sorted(failures, key=lambda f: f.rank)
        ]
    failed = [f for f in failures if f.exitcode != torn_down] or list(failures)
    lines = []
    for f in sorted(failed, key=lambda f: f.rank):
        error = last_error.get(f.local_rank)
        said = f"its last error line: {error}" if error else "no error line of its own"
        lines.append(
            f"{command}: rank {f.rank} (local rank {f.local_rank}, pid {f.pid}) {f.how()}, {said}; "
            f"torchrun's full output: {log_path}"
        )
    return lines


def _write(stream: BinaryIO | None, data: bytes) -> None:
    """To `stream`, else to our stderr's descriptor (unbuffered, whole)."""
    if stream is not None:
        with contextlib.suppress(OSError, ValueError):
            stream.write(data)
            stream.flush()
        return
    try:
        out = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(data.decode(errors="replace"))
        return
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(out, data) :]


def say(line: str) -> None:
    """One of launch's own lines on stderr, in order with the workers' lines written through the descriptor."""
    _write(None, (line + "\n").encode())
