"""A rank's two channels to the daemon: the step page it rewrites every step, the report socket it writes to.

The step page is STEP_PAGE_BYTES of shared memory that `TrainerLink.step()` writes through two
memoryviews (an aligned 8-byte store per figure, no syscall, tens of ns), so the daemon and the
launcher read the exact last step even after the rank was SIGKILLed. Under `gpuwatch launch` it
is a file in the launch's private directory (the launcher reads it after the rank is gone);
otherwise an anonymous memfd, sealed against resizing, that only the daemon gets (as SCM_RIGHTS
over the report socket).

`ReportSender` owns the SOCK_SEQPACKET connection to the daemon's REPORT_SOCKET: a hello naming the
protocol version first (with the step page's descriptor), then one report per message; the
daemon's hello, read as it comes, tells whether the two speak the same version. It never blocks a
rank for long: a full socket drops that report (the next one follows), a daemon that is down or
restarting is retried at the next report, and only the final report waits up to a second.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import mmap
import os
import socket
import stat
import time
from pathlib import Path

from gpuwatch.base.unixsock import address as unix_address
from gpuwatch.errors import JobError
from gpuwatch.trainer.contract import (
    LAUNCH_DIR_ENV,
    NO_STEP,
    REPORT_PROTOCOL,
    REPORTS_REQUIRED_ENV,
    STEP_LAYOUT,
    STEP_PAGE_BYTES,
    STEP_PAGE_MAGIC,
    hello,
    hello_protocol,
    step_page_name,
)

log = logging.getLogger("gpuwatch.trainer")

_CONNECT_TIMEOUT_S = 1.0
_FINAL_SEND_TIMEOUT_S = 1.0
_BACKLOG_RETRY_S = 0.001  # a full backlog (another user's storm) is tried again this often, within the timeout
_SENDS_BEFORE_NO_HELLO = 3  # reports sent on a connection with no hello back: the daemon predates the hello


class StepPageWriter:
    """The rank's step page: a file in the launch directory when one is given and safe, else a memfd."""

    def __init__(self, pid: int, launch_dir: str | None = None) -> None:
        self.path: Path | None = None
        self.fd = self._open_file(pid, launch_dir) if launch_dir else None
        if self.fd is None:
            self.fd = _memfd()
        os.ftruncate(self.fd, STEP_PAGE_BYTES)
        if self.path is None:
            _seal(self.fd)
        self._map = mmap.mmap(self.fd, STEP_PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        STEP_LAYOUT.pack_into(self._map, 0, STEP_PAGE_MAGIC, NO_STEP, NO_STEP, 0.0, 0.0)
        self.ints = memoryview(self._map).cast("q")  # slot i is bytes 8i..8i+7: STEP_SLOT, FIRST_STEP_SLOT
        self.floats = memoryview(self._map).cast("d")  # STEP_T_SLOT, FIRST_STEP_T_SLOT

    def close(self) -> None:
        """Close the descriptor; the mapping stays (64 bytes), so a `step()` after the link closed is harmless.

        The launcher's file stays for the launcher; a memfd lives on where it was passed (the daemon).
        """
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def _open_file(self, pid: int, launch_dir: str) -> int | None:
        """`<launch_dir>/<pid>.step`, only in a directory that is ours alone (the launcher made it 0700)."""
        try:
            st = os.stat(launch_dir, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                log.warning("%s=%s is not a directory of ours alone: no step page there", LAUNCH_DIR_ENV, launch_dir)
                return None
            path = Path(launch_dir) / step_page_name(pid)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("no step page in %s: %s", launch_dir, exc.strerror or exc)
            return None
        self.path = path
        return fd


class ReportsUnreachable(JobError, RuntimeError):
    """Under `gpuwatch launch`, the daemon's report socket cannot be reached at start: no quarantine could stop
    this rank, so it does not train."""


class ReportSender:
    """The connection to the daemon's report socket; used by the link's thread only."""

    def __init__(self, socket_path: Path, page_fd: int | None) -> None:
        self.socket_path = socket_path
        self.page_fd = page_fd
        self._sock: socket.socket | None = None
        self._page_sent = False
        self._failed = False
        self.dropped = 0
        self.daemon_protocol: int | None = None  # what the daemon's hello said (1: it sent none)
        self._unanswered = 0

    def send(self, data: bytes, *, final: bool = False) -> bool:
        """Send one report; True when the daemon has it queued. The final one may wait up to a second."""
        sock = self._sock or self._connect()
        if sock is None:
            return False
        sock.settimeout(_FINAL_SEND_TIMEOUT_S if final else 0.0)
        try:
            if not self._page_sent:  # the hello, with the step page: what the daemon reads first
                fds = [self.page_fd] if self.page_fd is not None else []
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
                sock.sendmsg([hello(os.getpid())], rights)
                self._page_sent = True
            sock.send(data)
        except (BlockingIOError, TimeoutError):
            self.dropped += 1  # the daemon is behind: this report is skipped, the next one carries the news
            return False
        except OSError as exc:
            self._lost(f"gpuwatch trainer report not sent: {exc.strerror or exc}")
            return False
        if self._failed:
            log.info("gpuwatch trainer reports reach %s again", self.socket_path)
            self._failed = False
        self._read_hello(sock)
        return True

    def _read_hello(self, sock: socket.socket) -> None:
        """Take the daemon's hello when it has come; say once when its version is not ours, or it sends none."""
        if self.daemon_protocol is not None:
            return
        try:
            data = sock.recv(256, socket.MSG_DONTWAIT)
        except OSError:
            data = b""
        version = hello_protocol(data) if data else None
        if version is None:
            self._unanswered += 1
            if self._unanswered < _SENDS_BEFORE_NO_HELLO:
                return
            version = 1
        self.daemon_protocol = version
        if version != REPORT_PROTOCOL:
            log.warning(
                "the gpuwatch daemon at %s speaks report protocol %d, this rank's gpuwatch %d: "
                "reports go on as far as both understand them; install the same gpuwatch in both",
                self.socket_path, version, REPORT_PROTOCOL,
            )  # fmt: skip

    def connect_or_raise(self) -> None:
        """Connect now (the first report uses this connection); ReportsUnreachable, one line, when it cannot."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(_CONNECT_TIMEOUT_S)
        try:
            with unix_address(self.socket_path) as address:
                sock.connect(address)
        except OSError as exc:
            sock.close()
            raise ReportsUnreachable(
                f"gpuwatch trainer: {REPORTS_REQUIRED_ENV} is set (gpuwatch launch) and reports cannot reach "
                f"{self.socket_path}: {exc.strerror or exc}; is the daemon running with runtime dir "
                f"{self.socket_path.parent}?"
            ) from None
        self._sock, self._page_sent = sock, False

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket | None:
        """Connect; a full backlog (EAGAIN: the daemon is pacing another user's connect storm) is retried
        for up to _CONNECT_TIMEOUT_S, every millisecond: the daemon drains the whole backlog at each turn, and
        the storm refills it within milliseconds, so a rank that looked less often would miss the turn."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(_CONNECT_TIMEOUT_S)
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        try:
            with unix_address(self.socket_path) as address:
                while True:
                    try:
                        sock.connect(address)
                        break
                    except BlockingIOError:
                        if time.monotonic() + _BACKLOG_RETRY_S > deadline:
                            raise
                        time.sleep(_BACKLOG_RETRY_S)
        except OSError as exc:
            sock.close()
            # Common without a daemon (no runtime dir): say it once, keep trying quietly.
            self._lost(f"gpuwatch trainer reports cannot reach {self.socket_path}: {exc.strerror or exc}")
            return None
        self._sock, self._page_sent, self._unanswered = sock, False, 0
        return sock

    def _lost(self, message: str) -> None:
        (log.debug if self._failed else log.warning)("%s", message)
        self._failed = True
        self.close()


def _memfd() -> int:
    return os.memfd_create("gpuwatch-step-page", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def _seal(fd: int) -> None:
    """Fix the memfd's size: whoever maps it can never find it shrunk under a read."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
