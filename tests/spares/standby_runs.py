"""A user's loop (tests/spares/user_loop.py) under `gpuwatch launch --in-place` with the sim daemon, and what its
own logs say: the tests of standby spares and the GPU script share this."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.helpers import launch_env
from tests.inplace.jobs import InPlaceRun, by_pid

LOOP = str(Path(__file__).with_name("user_loop.py"))


def launch_loop(
    node: DaemonProcess, workdir: Path, launch_args: tuple[str, ...], loop_args: tuple[str, ...], **env: str
) -> InPlaceRun:
    """`gpuwatch launch --in-place LAUNCH_ARGS -- user_loop.py LOOP_ARGS`; its logs in workdir/steps, its host
    snapshots under workdir/shm, its gate file workdir/gate (absent: the loop waits at step 10)."""
    logs = workdir / "steps"
    command = [
        sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
        "--in-place", *launch_args, "--", LOOP, "--log-dir", str(logs), "--gate", str(workdir / "gate"), *loop_args,
    ]  # fmt: skip
    (workdir / "shm").mkdir(parents=True, exist_ok=True)
    full = launch_env(GPUWATCH_SNAPSHOT_ROOT=str(workdir / "shm"), **env)
    process = subprocess.Popen(
        command, env=full, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return InPlaceRun(process, logs)


def open_gate(workdir: Path) -> None:
    (workdir / "gate").touch()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def waiting_standbys(run: InPlaceRun) -> list[int]:
    """Processes that finished the loop's set-up (its setup file) and took no step yet, still running."""
    stepped = {line["pid"] for line in run.steps()}
    pids = [int(p.name.split(".")[1]) for p in run.logs.glob("setup.*.json")]
    return [pid for pid in pids if pid not in stepped and alive(pid)]


def wait_for_standby(run: InPlaceRun, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while not (found := waiting_standbys(run)):
        assert run.process.poll() is None, run.output(0.1)
        assert time.monotonic() < deadline, f"no standby finished the set-up in {timeout_s} s: {run.output(0.1)}"
        time.sleep(0.1)
    time.sleep(0.3)  # from the set-up file to the join: TrainerLink's start
    return found[0]


def fault_short_of_snapshot(run: InPlaceRun, rank: int, every: int, how: str = "kill") -> tuple[int, float]:
    """SIGKILL (or SIGSTOP, then SIGKILL 1 s later: the hang's verdict) the pid of `rank` one step short of a
    snapshot (K - 1 steps to redo); its pid and the fault's time."""
    victim = next(ln["pid"] for ln in reversed(run.steps()) if ln["rank"] == rank)
    now = max(ln["step"] for ln in run.steps())
    run.wait_for(
        "a step short of a snapshot", lambda ls: any(ln["step"] > now and ln["step"] % every == every - 1 for ln in ls)
    )
    at = time.time()
    os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    if how == "stop":
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
    return victim, at


def kill_in_slow_step(run: InPlaceRun, step: int, into_s: float) -> tuple[int, float]:
    """SIGKILL the rank that logged `step` (the loop's --slow-step) `into_s` seconds after that line, in the
    slow step that follows it: its pid and the kill's time."""
    run.wait_for(f"step {step}", lambda ls: any(ln["step"] == step for ln in ls))
    line = next(ln for ln in run.steps() if ln["step"] == step)
    time.sleep(max(0.0, line["t"] + into_s - time.time()))
    at = time.time()
    os.kill(line["pid"], signal.SIGKILL)
    return line["pid"], at


def losses(lines: list[dict[str, Any]]) -> dict[tuple[int, int], set[float]]:
    """Every loss logged, by (step, rank): a redone step's too."""
    found: dict[tuple[int, int], set[float]] = {}
    for line in lines:
        found.setdefault((line["step"], line["rank"]), set()).add(line["loss"])
    return found


def redone_and_missing(own: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """One rank's log (the lost process's, then its replacement's): the steps redone and the steps never logged."""
    steps = [ln["step"] for ln in own]
    back = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), len(steps))
    redone = steps[back - 1] - steps[back] + 1 if back < len(steps) else 0
    missing = sorted(set(range(steps[0], max(steps) + 1)) - set(steps))
    return redone, missing


def rank_log(lines: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    """A rank's lines in the order its processes logged them."""
    mine = [ln for ln in lines if ln["rank"] == rank]
    order = sorted(by_pid(mine), key=lambda pid: min(ln["t"] for ln in mine if ln["pid"] == pid))
    return [ln for pid in order for ln in mine if ln["pid"] == pid]
