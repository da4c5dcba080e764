"""What the framework tests share: a user script under `gpuwatch launch` with the sim daemon, and its step log.

Each script (hf_train.py, lightning_train.py) writes the job's own step log, one file per rank:
"step PID N" when step N finished, "loss PID N LOSS"; the steps lost to a fault are read from it: the
furthest step the first launch finished against the step the next launch resumed from.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.launcher.test_launch_e2e import Node, _incident, _launch_job, _wait_for_ranks

HERE = Path(__file__).parent
TIMEOUT_S = 240  # two launches, each importing a framework on a loaded 2-core machine


@dataclass(frozen=True)
class StepLog:
    """One rank's step log: the steps each launch (pid) finished, in order, and each step's last loss."""

    launches: list[list[int]]
    losses: dict[int, float]

    @classmethod
    def read(cls, path: Path) -> StepLog:
        launches: dict[int, list[int]] = {}
        losses: dict[int, float] = {}
        for line in path.read_text().splitlines():
            kind, pid, step, *loss = line.split()
            if kind == "step":
                launches.setdefault(int(pid), []).append(int(step))
            else:
                losses[int(step)] = float(loss[0])
        return cls(list(launches.values()), losses)

    @property
    def furthest(self) -> int:
        """The furthest step the first launch finished."""
        return max(self.launches[0])

    @property
    def resumed_from(self) -> int:
        """The step the second launch resumed from (its first step, less one)."""
        return self.launches[1][0] - 1

    def lost(self) -> int:
        """Steps the first launch finished that the second did again."""
        return self.furthest - self.resumed_from


def launch(node: Node, script: str, out: Path, *args: str, max_restarts: int = 2) -> subprocess.Popen[str]:
    """`gpuwatch launch --nproc-per-node 2 -- SCRIPT --out OUT --log OUT.log ARGS`."""
    job = [str(HERE / script), "--out", str(out), "--log", f"{out}.log", *args]
    return _launch_job(node, out.parent, *job, max_restarts=max_restarts, nproc="2")


def wait_for_step(node: Node, proc: subprocess.Popen[str], step: int) -> list[dict[str, Any]]:
    return _wait_for_ranks(node, proc, ranks=2, step=step)


def quarantine(node: Node, gpu: int) -> None:
    subprocess.run(node.command("quarantine", str(gpu), "--reason", "test"), env=node.job_env, check=True, timeout=30)


def kill_rank(ranks: list[dict[str, Any]], rank: int) -> None:
    os.kill(next(r for r in ranks if r["rank"] == rank)["pid"], signal.SIGKILL)


def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"launch did not end: {stderr[-4000:]}") from None
    assert proc.returncode == 0, stderr[-6000:]
    return stdout, stderr


def incident(node: Node, status: str = "resumed") -> dict[str, Any]:
    return _incident(node, status)


__all__ = ["Node", "StepLog", "finish", "incident", "kill_rank", "launch", "quarantine", "wait_for_step"]
