"""One torchrun run: its process, our signals forwarded to it, and how it ended (its summary, its error file).

torchrun runs in its own session, so a terminal's Ctrl-C reaches it once (through us), not twice. Its
exit code says little (1 whatever its workers did): which worker failed and how comes from the summary
it prints on its stderr (TorchrunOutput) and from the error file it writes to TORCHELASTIC_ERROR_FILE
(only when the root-cause worker left one).

Locking: none shared. The launch loop's thread runs torchrun and waits; one copier thread owns its
stderr (and the TorchrunOutput) until it is joined; our signal handler only records and forwards.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.launcher.gpu_watch import StopSwitch
from gpuwatch.launcher.launch_plan import COMMAND, LaunchStopped
from gpuwatch.launcher.torchrun_output import Failure, TorchrunOutput, failure_lines, say
from gpuwatch.trainer.contract import EXIT_RESUME

_STOP_KILL_S = 60.0  # torchrun gives its workers 30 s after its SIGTERM


@dataclass(frozen=True)
class Outcome:
    """How one torchrun run ended: its exit code, the signal we forwarded to it, its failed workers."""

    rc: int
    forwarded: int | None = None
    failures: tuple[Failure, ...] = ()  # torchrun's root cause first
    stopped: str | None = None  # why launch stopped it itself (QuarantineWatch)
    errors: dict[int, str] = field(default_factory=dict)  # local rank → its own last error line
    log: str | None = None  # torchrun's full output


def run_torchrun(
    argv: list[str], env: dict[str, str], stop: StopSwitch | None = None, log_path: str | None = None
) -> Outcome:
    """Run torchrun in its own session; SIGINT/SIGTERM to us go to it once; `stop` ends it early. How it ended.

    Its own session, so a terminal's Ctrl-C reaches torchrun once (through us), not twice. Its stderr
    goes through TorchrunOutput: all of it to `log_path`, the workers' lines on to ours, and one line
    per failed rank at the end (torchrun's summary is also how we learn which worker failed and how:
    its error file is not written for a worker killed by a signal).

    Raises:
        LaunchStopped: torchrun could not be started.
    """
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE)
    except OSError as exc:
        raise LaunchStopped(2, f"cannot start torchrun ({argv[0]}): {exc.strerror or exc}") from None
    assert isinstance(proc.stderr, io.BufferedReader)
    with open(log_path or os.devnull, "ab") as log:
        output = TorchrunOutput(log)
        copier = threading.Thread(target=_copy, args=(proc.stderr, output), name="torchrun-stderr", daemon=True)
        copier.start()
        received: list[int] = []

        def forward(signum: int, _frame: object) -> None:
            received.append(signum)
            proc.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            rc = _wait(proc, stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        copier.join(timeout=5)
    failures = output.failures()
    stopped = stop.reason if stop is not None and stop.stopped else None
    if stopped is None and rc != 0:
        for line in failure_lines(failures, output.last_error, log_path or "(none)", COMMAND):
            say(line)
        if not failures and not received:
            error = output.own_error()
            say(f"{COMMAND}: torchrun exited {rc}{f': {error}' if error else ''}; its full output: {log_path}")
    return Outcome(rc, received[0] if received else None, failures, stopped, dict(output.last_error), log_path)


def _wait(proc: subprocess.Popen[bytes], stop: StopSwitch | None) -> int:
    """torchrun's exit code; when `stop` is set first, SIGTERM to torchrun (it tears its workers down), and
    SIGKILL if it has not ended _STOP_KILL_S later."""
    while stop is not None and not stop.stopped:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
    if stop is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=_STOP_KILL_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _copy(stream: io.BufferedReader, output: TorchrunOutput) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        output.feed(chunk)
    output.finish()


def root_cause(error_file: Path) -> tuple[int | None, str]:
    """The root-cause worker's exit code and first message line from torchrun's error file (None, "" if absent).

    torchrun writes it only when the root-cause worker left its own error file (TrainerLink's
    exit_for_resume does; a worker killed by a signal cannot): the summary on its stderr is the
    source that is always there (`failures`).
    """
    try:
        body = json.loads(error_file.read_text())
    except (OSError, ValueError):
        return None, ""
    message = body.get("message") if isinstance(body, dict) else None
    if isinstance(message, dict):
        code, text = message.get("errorCode", body.get("errorCode")), message.get("message", "")
    else:
        code, text = body.get("errorCode") if isinstance(body, dict) else None, message or ""
    lines = str(text).strip().splitlines()
    return (code if isinstance(code, int) else None), (lines[0] if lines else "")


def cause_of(failures: Sequence[Failure]) -> Failure | None:
    """The failure that ended the launch: torchrun's root cause, unless that is a rank that exited 75
    in the same second as a real failure (torchrun orders failures by whole seconds) or a teardown."""
    if not failures:
        return None
    root = failures[0]
    if root.exitcode in (EXIT_RESUME, -signal.SIGTERM):
        real = [f for f in failures if f.exitcode not in (EXIT_RESUME, -signal.SIGTERM)]
        if real:
            return real[0]
    return root
