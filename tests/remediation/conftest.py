"""Ranks as real processes for the remediation tests: each runs its signal set-up, says it is ready, and sleeps."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

# What each kind of rank does with the stop signal and SIGTERM (Python code run before it sleeps).
BEHAVIOUR = {
    "cooperative": "signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))",
    "ignores_stop": "signal.signal(signal.SIGUSR1, signal.SIG_IGN)",
    "ignores_term": "signal.signal(signal.SIGUSR1, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)",
}
Spawn = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """`spawn(behaviour="cooperative")`: a rank process, killed (and continued, if stopped) at the end."""
    children: list[subprocess.Popen[str]] = []

    def start(behaviour: str = "cooperative") -> subprocess.Popen[str]:
        code = f"import os, signal, time; {BEHAVIOUR[behaviour]}; print('ready', flush=True); time.sleep(60)"
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait()
