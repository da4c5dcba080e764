"""A private single-node Slurm for tests: munged, slurmctld and slurmd in a temp dir on free ports.

Debian's slurm-wlm and munge, run as root in the foreground; SLURM_CONF in `env` points scontrol
(and any gpuwatch started with that env) at it. The node is `gwnode`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import free_port

NODE = "gwnode"
PROGRAMS = ("munged", "slurmctld", "slurmd", "scontrol")


@dataclass
class Slurm:
    """The running trio and how to talk to it."""

    root: Path
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]]

    def scontrol(self, *args: str) -> str:
        proc = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def node(self) -> tuple[str, str]:
        """(State, Reason without its [user@time] suffix) of the node."""
        text = self.scontrol("show", "node", NODE)
        state = text.split("State=", 1)[1].split()[0]
        reason = ""
        for line in text.splitlines():
            if line.strip().startswith("Reason="):
                reason = line.strip().removeprefix("Reason=").rsplit(" [", 1)[0]
        return state, reason

    def drained(self) -> bool:
        return "DRAIN" in self.node()[0]

    def reset(self) -> None:
        """Back in service with no reason, whoever drained it."""
        if self.drained():
            self.scontrol("update", f"NodeName={NODE}", "State=RESUME")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def start_slurm(root: Path) -> Slurm:
    """Start munged, slurmctld and slurmd; skip when not root (slurmd and munged's socket need it)."""
    if os.geteuid() != 0:
        pytest.skip("a private slurmctld and slurmd need root (CI runs as root)")
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: apt-get install slurm-wlm munge (.ci/run does)")
    root.chmod(0o700)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=gwtest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root / 'munge.sock'}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/builtin",
                "SelectType=select/linear",
                f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES State=UP",
                "",
            ]
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munge = [
        "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={root / 'munge.sock'}",
        f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munge.seed'}",
    ]  # fmt: skip
    slurm = Slurm(root, env, [])
    log = (root / "console.log").open("ab")
    try:
        slurm.processes.append(subprocess.Popen(munge, env=env, stdout=log, stderr=log))
        _wait(lambda: (root / "munge.sock").exists(), "munged socket", slurm)
        slurm.processes.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=log, stderr=log))
        slurm.processes.append(subprocess.Popen(["slurmd", "-D", "-N", NODE], env=env, stdout=log, stderr=log))
        _wait(lambda: _idle(slurm), f"node {NODE} idle", slurm)
    except BaseException:
        slurm.stop()
        raise
    return slurm


def _idle(slurm: Slurm) -> bool:
    proc = subprocess.run(["scontrol", "show", "node", NODE], env=slurm.env, capture_output=True, text=True, timeout=10)
    return proc.returncode == 0 and "State=IDLE " in proc.stdout


def _wait(ready: Callable[[], bool], what: str, slurm: Slurm, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if any(p.poll() is not None for p in slurm.processes):
            break
        time.sleep(0.2)
    raise RuntimeError(f"slurm: no {what} within {timeout_s:g} s\n{slurm.logs()}")
