"""Sending a signal to a rank, and only to that rank: through a pidfd, after checking who the process is now.

A pid alone names whatever process has it when the signal is sent: between a check and os.kill
the rank may have exited and the pid been reused. A pidfd names one process for good, so the checks
made after opening it hold at the send: the same start time (not a recycled pid), the same user in
every uid (a rank that exec'd a setuid program such as `su` now runs as another user), and the
same program (a rank that exec'd something else is no longer a rank). Where pidfds are missing
(Linux < 5.3, seccomp) the same checks run right before os.kill.
"""

from __future__ import annotations

import logging
import os
import signal

from gpuwatch.base.procfs import ProcFs
from gpuwatch.node.ranks import Rank

log = logging.getLogger("gpuwatch.remediation")

SENT, GONE, REFUSED = "sent", "gone", "refused"


def send(rank: Rank, sig: signal.Signals, proc: ProcFs) -> str:
    """SENT, GONE (it ended, or its pid is another process now) or REFUSED (it is not the rank any more)."""
    fd = _pidfd(rank.pid)
    try:
        why = _not_the_rank(rank, proc)
        if why == GONE:
            return GONE
        if why:
            log.error("pid %d is no longer rank %s (%s): %s not sent", rank.pid, rank.info.rank, why, sig.name)
            return REFUSED
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(rank.pid, sig)
        except ProcessLookupError:
            return GONE
        except PermissionError:
            log.error("not allowed to send %s to pid %d (rank %s)", sig.name, rank.pid, rank.info.rank)
            return REFUSED
        return SENT
    finally:
        if fd is not None:
            os.close(fd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone (then the identity check says so), or no pidfds here
        return None


def _not_the_rank(rank: Rank, proc: ProcFs) -> str:
    """'' when the process is the rank still; GONE; or why it is not."""
    now = proc.identity(rank.pid)
    if now is None or (rank.start_time is not None and now.start_time != rank.start_time):
        return GONE
    if rank.uid is not None and now.uids and any(uid != rank.uid for uid in now.uids):
        return f"it runs as uid {'/'.join(str(u) for u in now.uids)}, the rank ran as uid {rank.uid}"
    if rank.exe is not None and now.exe is not None and now.exe != rank.exe:
        return f"it runs {now.exe} now, the rank ran {rank.exe}"
    return ""
