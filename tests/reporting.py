"""Rank stand-ins that report over the daemon's real report socket, as TrainerLink does.

The kernel names the sender of every report (SO_PEERCRED), so a test cannot write a report "for"
a pid: each FakeRank is a real process that sends, with its own pid, exactly what the test tells
it, and keeps a step page the daemon reads. `behaviour` is Python run before it waits (its signal
set-up); it ends when killed or when its stdin closes and it was told to `exit_after`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwatch.node.runtime import RuntimeDir

ServeReports = Callable[[Path], RuntimeDir]  # the `serve_reports` fixture (tests/conftest.py)
SPIN = "import threading; threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()"
"""A behaviour that keeps the process busy on its CPU (a rank in an evaluation pass, or spinning in NCCL)."""

_CHILD = """
import json, os, signal, sys, time
from pathlib import Path
from gpuwatch.trainer.channel import ReportSender, StepPageWriter
from gpuwatch.trainer.contract import FIRST_STEP_SLOT, FIRST_STEP_T_SLOT, REPORT_SOCKET, STEP_SLOT, STEP_T_SLOT
{behaviour}
def answer(word):
    # One write: a stop's handler that exits between print's two writes would leave half a line.
    sys.stdout.write(word + "\\n")
    sys.stdout.flush()
page = StepPageWriter(os.getpid(), os.environ.get("GPUWATCH_LAUNCH_DIR"))
sender = None
print("ready", flush=True)
for line in sys.stdin:
    message = json.loads(line)
    if "page" in message:
        figures = message["page"]
        page.ints[STEP_SLOT] = figures["step"]
        page.ints[FIRST_STEP_SLOT] = figures.get("first_step", figures["step"])
        page.floats[STEP_T_SLOT] = figures.get("step_t", time.time())
        page.floats[FIRST_STEP_T_SLOT] = figures.get("first_step_t", page.floats[STEP_T_SLOT])
        answer("sent")
        continue
    if sender is None:
        sender = ReportSender(Path(message["runtime_dir"]) / REPORT_SOCKET, page.fd)
    body = {{"pid": os.getpid(), **message["report"]}}
    answer("sent" if sender.send(json.dumps(body).encode(), final=True) else "failed")
time.sleep(120)
"""


class FakeRank(subprocess.Popen[str]):
    """A real process that reports what it is told (`report`) and keeps a step page (`page`)."""

    def __init__(self, behaviour: str = "pass", env: dict[str, str] | None = None, uid: int | None = None) -> None:
        """`uid`: become that user once started (as root), as another local account's process would be:
        the interpreter may live where only root can reach it, so it starts as root and then drops."""
        become = f"os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})"
        code = _CHILD.format(behaviour=f"{become}\n{behaviour}" if uid is not None else behaviour)
        super().__init__(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.stdout is not None and self.stdout.readline() == "ready\n", "the fake rank did not start"

    def report(self, runtime_dir: str | Path, **fields: Any) -> bool:
        """Send one report (pid filled in unless given), queued at the daemon's socket when this returns.

        False when the process has ended (a stop the test provoked may have ended it first), or when
        the daemon refused the connection (its peer may close before or after the send is queued).
        """
        return self._say({"runtime_dir": str(runtime_dir), "report": fields})

    def page(self, step: int, first_step: int | None = None, step_t: float | None = None) -> bool:
        """Set the step page as TrainerLink.step() would; False when the process has ended."""
        figures: dict[str, Any] = {"step": step, "first_step": step if first_step is None else first_step}
        if step_t is not None:
            figures["step_t"] = step_t
        return self._say({"page": figures})

    def end(self) -> None:
        """Kill it, continued first if a test stopped it, and reap it."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.kill()
        self.wait()

    def _say(self, message: dict[str, Any]) -> bool:
        assert self.stdin is not None and self.stdout is not None
        try:
            self.stdin.write(json.dumps(message) + "\n")
            self.stdin.flush()
        except BrokenPipeError:
            return False
        answer = self.stdout.readline()
        if not answer or answer == "failed\n":
            return False
        assert answer == "sent\n", f"fake rank {self.pid}: {answer!r}"
        return True


def report_fields(runtime: RuntimeDir, pid: int) -> dict[str, Any]:
    """Process `pid`'s report as the daemon holds it, under the contract's names ({} when there is none)."""
    report = runtime.read_report(pid)
    if report is None:
        return {}
    fields = dataclasses.asdict(report.info)
    fields["t"] = fields.pop("updated_t")
    return fields


def reports_by_rank(runtime: RuntimeDir) -> dict[int, dict[str, Any]]:
    """Every report the daemon holds, by rank, under the contract's names."""
    return {r.info.rank: report_fields(runtime, r.info.pid) for r in runtime.read_reports() if r.info.rank is not None}
