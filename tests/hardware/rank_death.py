#!/usr/bin/env python3
"""Rank death (or the fault-rank drill's XID 31) under `gpuwatch launch`, timed: fault → first resumed step.

    python tests/hardware/rank_death.py --backend nvml                 # two H200s: SIGKILL rank 1 (NCCL)
    python tests/hardware/rank_death.py --backend nvml --fault xid31   # rank 1 raises XID 31 in its own context
    python tests/hardware/rank_death.py --backend nvml --fault hang    # rank 1 SIGSTOPped, rank 0 told to stop
    python tests/hardware/rank_death.py --backend sim                  # the same on the CPU (gloo, 2 sim GPUs)

It starts a daemon (`gpuwatch run`, its own state and runtime dirs under --workdir, its own port),
runs the example trainer under `gpuwatch launch` on every usable GPU, waits until both ranks are
past --fault-at, then SIGKILLs rank 1 (or sends it SIGUSR2: with --allow-drills the link raises a
real, harmless XID 31 in rank 1's CUDA context), or with --fault hang SIGSTOPs rank 1 and sends
rank 0 the stop signal as the daemon would: rank 0, blocked in the collective, must get out (NCCL:
the link aborts the process group after --abort-after; gloo: at the group's timeout) and save; the
script then SIGKILLs the stopped rank (the daemon's kill_after_s) and times `stop_to_survivor_out_s`
too. It times the first report of the relaunch that
carries a step (written at once, issue 16), waits for the job to finish and prints one JSON line:
{"fault", "backend", "fault_to_first_resumed_step_s", "steps_lost", "restarts", "resumed_from",
"launch_rc", ...}, then the launcher's relaunch lines. Exit 0 when the job finished with 0 steps
lost (with --no-rescue: when it finished) after a relaunch, else 1. Nothing on the GPUs is changed; XID 31 only
ends rank 1's own CUDA context.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuwatch.testing.daemon_process import DaemonProcess, child_env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    parser.add_argument("--fault", choices=("kill", "xid31", "hang"), default="kill")
    parser.add_argument("--abort-after", type=float, default=5.0, help="the trainer's TrainerLink abort_after_s")
    parser.add_argument("--no-rescue", action="store_true", help="resume from the periodic checkpoint instead")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--fault-at", type=int, default=120, help="fault once both ranks passed this step")
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpuwatch-rank-death-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    sim = ["--sim-gpus", "2", "--sim-scenario", "healthy"] if args.backend == "sim" else []
    with DaemonProcess(work, "--interval", "1", *sim, backend=args.backend) as daemon:
        example = ["-m", "gpuwatch.examples.trainer", "--ckpt-dir", str(work / "ckpt"), "--steps", str(args.steps)]
        example += ["--ckpt-every", str(args.ckpt_every), "--step-sleep", str(args.step_sleep)]
        example += ["--report-interval", "0.5", "--abort-after", str(args.abort_after), "--gloo-timeout", "10"]
        example += ["--no-rescue"] if args.no_rescue else []
        example += ["--allow-drills"] if args.fault == "xid31" else []
        launch = subprocess.Popen(
            [
                *daemon.command("launch", "--runtime-dir", str(daemon.runtime_dir), "--max-restarts", "2"),
                "--",
                *example,
            ],
            env=env,
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=open(work / "launch.log", "w"),
            text=True,
        )
        ranks = _wait_for_ranks(daemon, launch, step=args.fault_at)
        victim = ranks[1]
        fault_t = time.time()
        survivor_out_s = None
        if args.fault == "hang":
            os.kill(victim["pid"], signal.SIGSTOP)
            time.sleep(1)  # rank 0 is now blocked in the step's collective
            fault_t = time.time()
            os.kill(ranks[0]["pid"], signal.SIGUSR1)
            survivor_out_s = _wait_ended(daemon, ranks[0]["pid"], launch) - fault_t
            os.kill(victim["pid"], signal.SIGKILL)
        else:
            os.kill(victim["pid"], signal.SIGKILL if args.fault == "kill" else signal.SIGUSR2)
        first = _first_resumed_report(daemon, launch, after=fault_t, old={r["pid"] for r in ranks.values()})
        stdout, _ = launch.communicate(timeout=600)
    summary = _last_json(stdout)
    result = {
        "fault": args.fault,
        "backend": args.backend,
        "rescue": not args.no_rescue,
        "fault_at_step": victim.get("step"),
        "fault_to_first_resumed_step_s": round(first["t"] - fault_t, 2) if first else None,
        "stop_to_survivor_out_s": round(survivor_out_s, 2) if survivor_out_s is not None else None,
        "first_resumed_step": first.get("first_step") if first else None,
        "steps_lost": summary.get("lost_steps"),
        "restarts": summary.get("restarts"),
        "resumed_from": summary.get("resumed_from_steps"),
        "steps_done": summary.get("steps_done"),
        "launch_rc": launch.returncode,
        "workdir": str(work),
    }
    print(json.dumps(result), flush=True)
    for line in (work / "launch.log").read_text().splitlines():
        if line.startswith("gpuwatch launch:") or "rescued step" in line or "fault drill" in line:
            print(line)
    ok = first is not None and launch.returncode == 0 and summary.get("steps_done") == args.steps
    return 0 if ok and (args.no_rescue or summary.get("lost_steps") == 0) else 1


def _wait_for_ranks(daemon: DaemonProcess, launch: subprocess.Popen[str], *, step: int) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        live = {r["rank"]: r for r in daemon.trainer_reports() if r.get("ended") is None}
        if len(live) >= 2 and all((r.get("step") or 0) >= step for r in live.values()):
            return live
        if launch.poll() is not None:
            raise SystemExit(f"gpuwatch launch exited {launch.returncode} before step {step}: see launch.log")
        time.sleep(0.05)
    raise SystemExit(f"the ranks did not reach step {step}")


def _first_resumed_report(
    daemon: DaemonProcess, launch: subprocess.Popen[str], *, after: float, old: set[int]
) -> dict[str, Any] | None:
    while True:
        new = [r for r in daemon.trainer_reports() if r["pid"] not in old and r.get("first_step") is not None]
        new = [r for r in new if r["t"] > after]
        if new:
            return min(new, key=lambda r: r["t"])
        if launch.poll() is not None:
            return None
        time.sleep(0.02)


def _wait_ended(daemon: DaemonProcess, pid: int, launch: subprocess.Popen[str]) -> float:
    """When rank `pid` left its final report (ended set), from the report's own time."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        report = next((r for r in daemon.trainer_reports() if r["pid"] == pid), None)
        if report is not None and report.get("ended") is not None:
            return float(report["t"])
        if launch.poll() is not None:
            break
        time.sleep(0.02)
    raise SystemExit(f"rank pid {pid} did not end after the stop: see launch.log")


def _last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


if __name__ == "__main__":
    sys.exit(main())
