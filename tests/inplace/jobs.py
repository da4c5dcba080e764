"""An in-place job under test: `gpuwatch launch --in-place` running the example trainer, and its own step logs.

Each rank of the example writes `steps.<pid>.jsonl` (one line per step: pid, member, generation,
rank, world, step, parameter checksum): the tests read their figures there, from the job itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.helpers import launch_env

TIMEOUT_S = 90
FSDP_PRELOAD = "gpuwatch.inplace.fsdp,torch.distributed.tensor.parallel,torch.distributed.checkpoint.state_dict"
# The daemon of today signals every rank of a job on a quarantine and escalates to SIGTERM after
# the grace period; the survivors of an in-place job ignore a stop about another GPU, so the grace
# period is set beyond any test's length (the daemon's in-place rules are not what is tested here).
# The tests freeze (SIGSTOP) and kill ranks themselves, standing in for the daemon: it must not race them.
DAEMON_ENV = {
    "GPUWATCH_TRAINER_GRACE_PERIOD_S": "600",
    "GPUWATCH_TRAINER_KILL_AFTER_S": "600",
    "GPUWATCH_TRAINER_HANG_STOPPED_AFTER_S": "600",
}


def sim_node(root: Path, gpus: int, seed: int = 1) -> DaemonProcess:
    args = ("--sim-scenario", "healthy", "--sim-gpus", str(gpus), "--interval", "1", "--seed", str(seed))
    return DaemonProcess(root, *args, env=DAEMON_ENV)


@dataclass
class InPlaceRun:
    """One `gpuwatch launch --in-place` process and the directory of its ranks' step logs."""

    process: subprocess.Popen[str]
    logs: Path

    def steps(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in sorted(self.logs.glob("steps.*.jsonl")):
            for line in path.read_text().splitlines():
                if line.endswith("}"):  # a line being written is skipped
                    found.append(json.loads(line))
        return found

    def wait_for(self, what: str, check: Callable[[list[dict[str, Any]]], bool], timeout_s: float = TIMEOUT_S) -> float:
        """Poll the step logs until `check` holds; the wall time (time.time()) when it did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check(self.steps()):
                return time.time()
            if self.process.poll() is not None:
                raise AssertionError(f"launch exited {self.process.returncode} waiting for {what}: {self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"not within {timeout_s} s: {what}: {self.output(0.1)}")

    def output(self, timeout_s: float = 60) -> tuple[str, str]:
        """The launcher's stdout and the end of its stderr once it exited (stopped if it does not in time)."""
        try:
            out, err = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            out, err = self.process.communicate()
        return out, err[-6000:]

    def stop(self) -> None:
        """SIGTERM to the launcher, which ends its ranks; still there 40 s later: SIGKILL to it and its ranks."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.process.kill()
            for pid in {line["pid"] for line in self.steps()}:  # the ranks run in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def ranks_at(self, step: int, world: int) -> list[dict[str, Any]]:
        """One line per pid that logged `step` at world size `world`."""
        return [line for line in self.steps() if line["step"] == step and line["world"] == world]


def post(node: DaemonProcess, path: str, body: dict[str, Any]) -> float:
    """POST `body` to the daemon's API with its token (what `gpuwatch quarantine` does, without the CLI's
    start-up); the time (time.time()) just before the request, so the decision lies after it."""
    request = urllib.request.Request(
        node.url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {node.token}", "Content-Type": "application/json"},
        method="POST",
    )
    sent = time.time()
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.read()
    return sent


def launch_in_place(
    node: DaemonProcess, workdir: Path, steps: int, *launch_args: str, step_sleep: float = 0.05, ckpt_every: int = 1000
) -> InPlaceRun:
    logs = workdir / "ckpt"
    command = [
        sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
        "--in-place", *launch_args,
        "--", "-m", "gpuwatch.examples.trainer", "--in-place", "--ckpt-dir", str(logs), "--steps", str(steps),
        "--step-sleep", str(step_sleep), "--report-interval", "0.2", "--gloo-timeout", "20",
        "--ckpt-every", str(ckpt_every),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, env=launch_env(), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return InPlaceRun(process, logs)


def launch_sharded(
    node: DaemonProcess, workdir: Path, steps: int, *launch_args: str, every: int = 3, step_sleep: float = 0.05
) -> InPlaceRun:
    """`gpuwatch launch --in-place` running gpuwatch.examples.sharded_worker (ZeroRedundancyOptimizer, a host
    snapshot every `every` steps, kept under workdir/shm); its step logs in workdir/steps."""
    worker = ["gpuwatch.examples.sharded_worker", "--steps", str(steps), "--every", str(every)]
    return _launch_snapshot_job(node, workdir, launch_args, [*worker, "--step-sleep", str(step_sleep)])


def launch_fsdp(
    node: DaemonProcess,
    workdir: Path,
    steps: int,
    *launch_args: str,
    every: int = 3,
    tp: int = 1,
    step_sleep: float = 0.02,
    worker_args: Sequence[str] = (),
) -> InPlaceRun:
    """`gpuwatch launch --in-place` running gpuwatch.examples.fsdp_worker (FSDP2, a 2-D mesh with tp > 1, a host
    snapshot every `every` steps, kept under workdir/shm); its step logs in workdir/steps."""
    worker = ["gpuwatch.examples.fsdp_worker", "--steps", str(steps), "--every", str(every), "--tp", str(tp)]
    worker += ["--step-sleep", str(step_sleep), *worker_args]
    preload = {"GPUWATCH_SPARE_PRELOAD": FSDP_PRELOAD}  # what docs/recovery-in-place.md asks an FSDP job to set
    return _launch_snapshot_job(node, workdir, launch_args, worker, preload)


def _launch_snapshot_job(
    node: DaemonProcess, workdir: Path, launch_args: Sequence[str], worker: list[str], env: dict[str, str] | None = None
) -> InPlaceRun:
    logs = workdir / "steps"
    command = [
        sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
        "--in-place", *launch_args, "--", "-m", *worker, "--log-dir", str(logs), "--collective-timeout", "20",
    ]  # fmt: skip
    (workdir / "shm").mkdir(parents=True, exist_ok=True)
    environ = launch_env(GPUWATCH_SNAPSHOT_ROOT=str(workdir / "shm"), **(env or {}))
    process = subprocess.Popen(
        command, env=environ, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return InPlaceRun(process, logs)


def kill_when_warm(
    run: InPlaceRun,
    ranks: int,
    rank: int,
    every: int,
    *,
    past: int = 30,
    freeze_s: float = 0.0,
    start_s: float = TIMEOUT_S,
) -> tuple[int, float]:
    """Past step `past` on every rank with a warm spare, SIGKILL `rank` after a step `every` - 1 past a snapshot
    (first SIGSTOP it for `freeze_s`, as the daemon kills a frozen rank); its pid and the time of the kill.
    `start_s` bounds the job's start (4 ranks and a spare importing torch on a shared 2-core machine)."""
    run.wait_for(
        f"{ranks} rank(s) past step {past}",
        lambda ls: len({ln["pid"] for ln in ls if ln["step"] >= past}) == ranks,
        start_s,
    )
    deadline = time.monotonic() + 90
    while not spare_warm(run.process.pid):
        assert time.monotonic() < deadline, "no spare got warm in 90 s"
        time.sleep(0.1)
    victim = next(ln["pid"] for ln in run.steps() if ln["rank"] == rank)
    now = max(ln["step"] for ln in run.steps())  # kill one step short of a snapshot: K - 1 steps to redo
    run.wait_for(
        "a step just short of a snapshot",
        lambda ls: any(ln["step"] > now and ln["step"] % every == every - 1 for ln in ls),
    )
    if freeze_s:
        os.kill(victim, signal.SIGSTOP)
        time.sleep(freeze_s)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    return victim, killed


def spare_warm(launcher: int) -> bool:
    """A spare of this launcher has imported torch and said so (it closed its ready pipe); other jobs' spares on
    the machine do not count."""
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            if (
                f"\nPPid:\t{launcher}\n" not in status
                or b"gpuwatch.spares.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                continue
            environ = dict(
                item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
            )
            if b"GPUWATCH_SPARE_NOW" not in environ and not os.path.exists(
                f"/proc/{pid}/fd/{environ[b'GPUWATCH_SPARE_READY_FD'].decode()}"
            ):
                return True
        except (OSError, KeyError):
            continue
    return False


def check_rank_log(own: list[dict[str, Any]], resumed: int, every: int) -> int:
    """One rank's log (a survivor's, or the lost rank's followed by its replacement's): the steps it redid after
    the kill, at most `every` (K), and none missing (its steps run on by one, and go back only to `resumed`, once).

    Counted from the log's own order, not the kill's time: a survivor may log the step the kill interrupted
    a moment after the kill, and that step is done (the newest common snapshot may hold it)."""
    steps = [ln["step"] for ln in own]
    at = max(i for i, step in enumerate(steps) if step == resumed)  # the first step after the recovery
    before = max(steps[:at], default=resumed - 1)
    redone = before - (resumed - 1)
    assert 0 <= redone <= every, (redone, steps)
    assert steps[:at] == list(range(steps[0], steps[0] + at)), steps  # nothing missing before it
    assert steps[at:] == list(range(resumed, resumed + len(steps) - at)), steps  # nor after it
    return redone


def by_pid(lines: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        found.setdefault(line["pid"], []).append(line)
    return found


def assert_no_step_lost_or_repeated(lines: Sequence[dict[str, Any]], pids: Sequence[int]) -> None:
    """Each of these ranks logged every step once, in order: nothing lost, nothing taken twice."""
    for pid, own in by_pid(lines).items():
        if pid in pids:
            steps = [line["step"] for line in own]
            assert steps == list(range(steps[0], steps[0] + len(steps))), (pid, steps)


def first_after(lines: Sequence[dict[str, Any]], t: float, pids: Sequence[int], world: int) -> dict[str, Any]:
    """The first step any of `pids` logged after `t` at world size `world`."""
    found = [line for line in lines if line["t"] > t and line["pid"] in pids and line["world"] == world]
    assert found, f"no step at world {world} after the fault"
    return min(found, key=lambda line: line["t"])
