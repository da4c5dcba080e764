"""measure_spare: a one-rank job that loses its rank, taken over by a warm spare or by a cold start.

    python -m gpuwatch.bench.recovery_spare --gib 1 4 16 [--faults kill xid stop] [--every K] [--spares N]
        [--workdir DIR]

prints one JSON line per state size and way of starting the replacement (spare, cold).

A job of one gpuwatch.examples.sharded_worker rank (a host snapshot every K steps) runs under the
in-place supervisor (in this process, on a thread; fake GPUs on the CPU, GPU 0 on a GPU machine).
Each fault in turn, once the rank is steady (5 steps and a host snapshot of its own committed) and,
with spares, one is warm:

* kill: SIGKILL (what the kill_rank drill sends);
* xid: SIGUSR2 to a rank with `allow_drills` (the fault_rank drill): it stores to an unmapped
  address from its own CUDA context, a real XID 31, and its next CUDA call fails (GPU only);
* stop: SIGSTOP, then SIGKILL after `hang_s` (what the daemon does to a frozen rank once its hang
  rule fired; the rule's own wait is the daemon's setting, not the spare's cost).

The figures come from the job's own step log: fault_to_step_s, the fault to the replacement's first
completed step; steps_redone, the furthest step logged before the fault minus the step restored
(from the host snapshot, so at most K); kill_to_step_s for `stop` counts from the SIGKILL; `parts`,
where those seconds went, each from the SIGKILL (for xid, the SIGUSR2): the dying rank's exit begun,
the launcher taking it for dead, the hand-over, the job's script started, imported, its model built,
its ShardedJob formed (with that change's own parts: rendezvous, group, state, DDP), its first step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuwatch.bench.recovery_in_place import _gpus, _lines, _run, _wait
from gpuwatch.launcher.in_place import InPlacePlan, Supervisor, exit_began
from gpuwatch.snapshots import job_dir_name, snapshot_root, user_dir_name
from gpuwatch.spares.pool import SparePool

FAULTS = ("kill", "xid", "stop")
_STEADY_STEPS = 5


def measure_spare(
    state_bytes: int,
    workdir: Path,
    *,
    spare: bool,
    faults: Sequence[str] = ("kill",),
    every: int = 5,
    step_sleep: float = 0.05,
    hang_s: float = 2.0,
    spares: int = 1,
    timeout_s: float = 300.0,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One job, each fault in turn; the figures above, one dict per fault (also passed to `report` as each comes).

    `spares`: how many the pool keeps (more than one: the next fault need not wait for a new one to warm up).

    Raises:
        ValueError: an unknown fault, xid without CUDA, or a negative state size.
        TimeoutError: a phase did not happen within timeout_s.
    """
    import torch

    cuda = torch.cuda.is_available()
    if state_bytes < 0 or any(f not in FAULTS for f in faults) or ("xid" in faults and not cuda):
        raise ValueError(f"bad measurement: state_bytes {state_bytes}, faults {list(faults)} (xid needs CUDA)")
    backend = "nccl" if cuda else "gloo"
    gpus = _gpus(backend, 1)
    logs = Path(workdir) / f"spare-{state_bytes}-{'spare' if spare else 'cold'}"
    logs.mkdir(parents=True, exist_ok=True)
    command = ["-m", "gpuwatch.examples.sharded_worker", "--log-dir", str(logs), "--state-bytes", str(state_bytes)]
    command += ["--every", str(every), "--step-sleep", str(step_sleep), "--backend", backend, "--allow-drills"]
    plan = InPlacePlan(
        job_id=f"spare-bench-{uuid.uuid4().hex[:8]}",
        command=tuple(command),
        runtime_dir=str(Path(workdir) / "run"),
        max_restarts=len(faults),
        daemon_poll_s=0.2,
    )
    pool = SparePool(spares, os.environ, cuda=cuda, echo=lambda _: None) if spare else None
    said: list[tuple[float, str]] = []  # the launcher's lines with their times: when it saw the exit, handed over
    supervisor = Supervisor(plan, lambda: gpus, echo=lambda line: said.append((time.time(), line)), spares=pool)
    result: list[BaseException | int] = []
    thread = threading.Thread(target=lambda: result.append(_run(supervisor)), name="bench-spare", daemon=True)
    thread.start()
    figures = []
    try:
        for fault in faults:
            entry = _one_fault(fault, logs, thread, pool, hang_s, timeout_s, said)
            entry.update(state_bytes=state_bytes, every=every, replacement="spare" if spare else "cold start")
            figures.append(entry)
            if report is not None:
                report(entry)
    finally:
        supervisor.stop()
        thread.join(timeout=60)
        shutil.rmtree(Path(snapshot_root()) / user_dir_name(os.getuid()) / job_dir_name(plan.job_id), True)
    return figures


def _one_fault(
    fault: str,
    logs: Path,
    thread: threading.Thread,
    pool: SparePool | None,
    hang_s: float,
    timeout_s: float,
    said: list[tuple[float, str]],
) -> dict[str, Any]:
    lines = _wait(logs, timeout_s, thread, "a steady rank", lambda ls: _steady(ls))
    deadline = time.monotonic() + timeout_s
    while pool is not None and not pool.warm():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no warm spare within {timeout_s:g} s")
        time.sleep(0.05)
    lines = _lines(logs)
    victim = max(lines, key=lambda ln: ln["t"])["pid"]
    spare_pid = pool.spares[0].process.pid if pool is not None and pool.spares else None
    spare_rss = pool.spares[0].rss_bytes() if pool is not None and pool.spares else None
    spare_gpu = _gpu_bytes(spare_pid) if spare_pid is not None and pool is not None and pool.cuda else None
    exiting = _ExitWatch(victim)
    faulted = time.time()
    killed = faulted
    if fault == "kill":
        os.kill(victim, signal.SIGKILL)
    elif fault == "xid":
        os.kill(victim, signal.SIGUSR2)
    else:
        os.kill(victim, signal.SIGSTOP)
        time.sleep(hang_s)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
    after = _wait(logs, timeout_s, thread, "the replacement's first step", lambda ls: _new(ls, victim, faulted))
    first = min(after, key=lambda ln: ln["t"])
    before = max(ln["step"] for ln in _lines(logs) if ln["pid"] == victim)
    exiting.stop()
    return {
        "fault": fault,
        "fault_to_step_s": round(first["t"] - faulted, 3),
        "kill_to_step_s": round(first["t"] - killed, 3),
        "steps_redone": before - (first["step"] - 1),
        "source": first.get("change", {}).get("source"),
        "spare_warm_s": first.get("spare_warm_s"),
        "spare_rss_bytes": spare_rss,
        "spare_gpu_bytes": spare_gpu,
        "replacement_start_to_step_s": round(first["t"] - first["started"], 3),
        "parts": _parts(first, killed, exiting.seen, said),
    }


def _parts(
    first: dict[str, Any], killed: float, exiting: float | None, said: list[tuple[float, str]]
) -> dict[str, Any]:
    """Where the seconds from the kill to the first step went, each counted from the kill (the SIGKILL, or
    the SIGUSR2 of xid): the dead rank's exit begun (/proc), the launcher's line that it is gone, the hand-over,
    the job's script started, imported, its model built, its ShardedJob formed; and the change's own parts."""

    def at(t: float | None) -> float | None:
        return None if t is None else round(t - killed, 3)

    dead = next((t for t, line in said if t >= killed and line.endswith(": the others go on")), None)
    handed = next((t for t, line in said if t >= killed and "a spare (pid" in line), None)
    marks = first.get("marks") or {}
    return {
        "exiting": at(exiting),
        "taken_for_dead": at(dead),
        "handed_over": at(handed),
        "script": at(first.get("started")),
        **{name: at(t) for name, t in marks.items()},
        "first_step": at(first["t"]),
        "change": first.get("change", {}).get("parts"),
    }


class _ExitWatch:
    """When a process's exit began (supervisor.exit_began, a 5 ms poll on a thread): before the kernel and
    the driver free its memory, which is when it is reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-exit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.seen is None and not self._done.wait(0.005):
            began = exit_began(self.pid)
            if began is None:
                return  # reaped before a poll saw it
            if began:
                self.seen = time.time()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=1)


def _gpu_bytes(pid: int) -> int | None:
    """The GPU memory process `pid` holds, as nvidia-smi reports it (None where it cannot say)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) << 20
    return None


def _steady(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest pid's lines once it took _STEADY_STEPS steps and committed a host snapshot of its own (a
    fault before that would find only what its predecessor left: not the fault measured here)."""
    if not lines:
        return []
    newest = max(lines, key=lambda ln: ln["t"])["pid"]
    own = [ln for ln in lines if ln["pid"] == newest]
    return own if len(own) >= _STEADY_STEPS and own[-1].get("committed") is not None else []


def _new(lines: list[dict[str, Any]], victim: int, t: float) -> list[dict[str, Any]]:
    return [ln for ln in lines if ln["pid"] != victim and ln["t"] > t and "started" in ln]


def _print(gib: float, entry: dict[str, Any]) -> None:
    print(json.dumps({"state_gib": gib, **entry}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Measure at each --gib, with a spare and with a cold start; one JSON line each."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuwatch.bench.recovery_spare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--gib", type=float, nargs="+", default=[0.1], help="state sizes (GiB)")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=["kill"])
    parser.add_argument("--cold-faults", nargs="*", choices=FAULTS, help="faults for the cold start (default: same)")
    parser.add_argument("--every", type=int, default=5, help="snapshot every K steps")
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--hang-s", type=float, default=2.0, help="stop: SIGSTOP to SIGKILL")
    parser.add_argument("--spares", type=int, default=1, help="spares the pool keeps (more: no wait between faults)")
    parser.add_argument("--workdir", help="default: a temporary directory")
    args = parser.parse_args(argv)
    if any(not gib >= 0 for gib in args.gib) or args.every < 1 or args.spares < 1:
        parser.error("--gib sizes must not be negative, --every and --spares must be positive")
    cold = args.faults if args.cold_faults is None else args.cold_faults
    with tempfile.TemporaryDirectory(prefix="gpuwatch-spare-bench-") as tmp:
        for gib in args.gib:
            for spare, faults in ((True, args.faults), (False, cold)):
                if not faults:
                    continue
                measure_spare(
                    int(gib * (1 << 30)), Path(args.workdir or tmp), spare=spare, faults=faults, every=args.every,
                    step_sleep=args.step_sleep, hang_s=args.hang_s, spares=args.spares,
                    report=functools.partial(_print, gib),
                )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
