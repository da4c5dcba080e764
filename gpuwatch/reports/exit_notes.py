"""A launcher's exit note (gpuwatch.trainer.contract.exit_note): which rank's exit began, and when.

The note is untrusted input: any local user may send anything on the report socket. Here it is only parsed
and bounded (a positive pid; a finite time neither in the future beyond NOTE_FUTURE_S nor older than
NOTE_PAST_S); who may date which rank's death (its parent, the same user) the board decides.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gpuwatch.reports.parse import ReportError

NOTE_FUTURE_S = 1.0  # a note's time may lead the daemon's clock by this much (the same host: clock reads only)
NOTE_PAST_S = 60.0  # ... and trail it by at most this (the launcher sends it milliseconds after the exit began)
_MAX_PID = 1 << 22  # the kernel's pid_max ceiling


def parse_exit_note(data: bytes, now: float) -> tuple[int, float]:
    """The (pid, time) of an exit note received at Unix time `now`.

    Raises:
        ReportError: not an exit note of this shape, or a time out of bounds, in one line saying which.
    """
    try:
        body: Any = json.loads(data)
    except (ValueError, RecursionError):
        raise ReportError("an exit note that is not JSON") from None
    note = body.get("rank_exit") if isinstance(body, dict) and len(body) == 1 else None
    if not isinstance(note, dict) or set(note) != {"pid", "t"}:
        raise ReportError('an exit note must be {"rank_exit": {"pid": P, "t": T}}')
    pid, t = note["pid"], note["t"]
    if type(pid) is not int or not 0 < pid < _MAX_PID:
        raise ReportError(f"an exit note's pid must be a process id, not {pid!r:.40}")
    if type(t) not in (int, float) or not math.isfinite(t):
        raise ReportError(f"an exit note's t must be a Unix time, not {t!r:.40}")
    if t > now + NOTE_FUTURE_S:
        raise ReportError(f"an exit note for pid {pid} dated {t - now:.3f} s in the future")
    if t < now - NOTE_PAST_S:
        raise ReportError(f"an exit note for pid {pid} dated {now - t:.1f} s ago, more than {NOTE_PAST_S:.0f} s")
    return pid, float(t)
