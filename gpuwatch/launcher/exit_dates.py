"""The launcher tells the daemon when a rank's exit began: the daemon itself sees a death only at its end.

A killed rank with many GiB of pinned memory takes the kernel a second or more to tear down, and the
daemon's exit watch fires only then; its guess of the onset (the last step's end plus a step time) errs by
the step in flight. The in-place launcher sees the exit of a rank under the spare's runner (every rank of
a launch with spares) begin within milliseconds (its runner's last word, its /proc flags), so it sends an
exit note on the daemon's report socket, the channel its ranks report on, as the rank's parent: the daemon
takes a note from that process only (gpuwatch.reports.board). A rank without the runner is known only at
its reap, after the teardown: no note (the daemon's guess is closer).
A note that cannot be sent (no daemon) costs nothing but the daemon's guess.
"""

from __future__ import annotations

from pathlib import Path

from gpuwatch.trainer.channel import ReportSender
from gpuwatch.trainer.contract import REPORT_SOCKET, exit_note


class ExitDates:
    """The launcher's connection to the daemon's report socket, for exit notes only; one thread uses it."""

    def __init__(self, runtime_dir: str) -> None:
        self._sender = ReportSender(Path(runtime_dir) / REPORT_SOCKET, None)

    def exit_began(self, pid: int, t: float) -> bool:
        """Say that the exit of rank `pid` (a child of this process) began at Unix time `t`; True when sent."""
        return self._sender.send(exit_note(pid, t))

    def close(self) -> None:
        self._sender.close()
