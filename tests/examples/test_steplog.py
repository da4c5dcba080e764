"""The workloads' step log: a line is on disk as soon as it is written (a SIGKILL loses no finished line)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.examples.steplog import StepLog

_KILLED_WRITER = """
import os, signal, sys
from gpuwatch.examples.steplog import StepLog
log = StepLog.per_process(sys.argv[1])
log.write(step=1)
log.write(step=2, t=12.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_leaves_every_line_it_wrote(tmp_path: Path) -> None:
    logs = tmp_path / "steps"  # made by the log
    before = time.time()
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(logs)], check=False, timeout=60)
    assert child.returncode == -9
    [path] = list(logs.iterdir())
    assert path.name.startswith("steps.") and path.name.endswith(".jsonl")  # steps.<the child's pid>.jsonl
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["step"] == 1 and before <= first["t"] <= time.time()
    assert second == {"t": 12.5, "step": 2}  # a time the workload took itself is kept


def test_lines_are_appended_to_an_existing_log(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    with StepLog(path) as log:
        log.write(launch=0)
    with StepLog(path) as log:
        log.write(launch=1)
    assert [json.loads(line)["launch"] for line in path.read_text().splitlines()] == [0, 1]
