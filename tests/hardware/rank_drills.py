#!/usr/bin/env python3
"""The rank drills end to end on real GPUs: a job under `gpuwatch launch`, `gpuwatch drill` against it.

    python tests/hardware/rank_drills.py --backend nvml --out results.json   # two H200s (NCCL)
    python tests/hardware/rank_drills.py --backend sim --trainers example     # the same chain on the CPU

For each trainer (the shipped example, and tests/hardware/readme_trainer.py written from the README's
snippet) it starts the job on every usable GPU, waits until both ranks are past --warmup steps, runs
`gpuwatch drill --kill-rank 1 --yes`, waits for the job to run again and get --warmup steps further,
then (--drills) `--fault-rank 0` (a real XID 31 in rank 0's own CUDA context) and `--hang-rank 1`
(SIGSTOP; the daemon runs with trainer.hang_after_s 10 and stale_after_s 5 so the hang is found
in seconds), and finally lets the job finish. It records each drill's verdict (steps, times, the
steps lost the daemon's incident counts), the daemon's incidents and the job's own summary, and
prints them as one JSON document. Exit 0 when every drill passed and every job finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuwatch.testing.daemon_process import DaemonProcess, child_env, last_json, wait_until

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    parser.add_argument("--trainers", default="example,readme")
    parser.add_argument("--drills", default="kill_rank,fault_rank,hang_rank")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-rank-drills-"))
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    sim = ["--sim-gpus", "2", "--sim-scenario", "healthy"] if args.backend == "sim" else []
    hang_in_seconds = {"GPUWATCH_TRAINER_HANG_AFTER_S": "10", "GPUWATCH_TRAINER_STALE_AFTER_S": "5"}
    daemon = DaemonProcess(work, "--interval", "1", *sim, backend=args.backend, env=hang_in_seconds)
    results: dict[str, Any] = {"backend": args.backend, "jobs": []}
    ok = True
    try:
        daemon.start()
        for trainer in args.trainers.split(","):
            job = _run_job(trainer, args, daemon, {**env, **hang_in_seconds})
            results["jobs"].append(job)
            ok = ok and job["ok"]
            _save(results, args.out)
        results["incidents"] = daemon.get("/v1/incidents?limit=50").get("incidents")
    finally:
        daemon.stop()
        results["daemon_log_tail"] = daemon.log_text()[-6000:]
        _save(results, args.out)
    print(json.dumps(results, indent=1))
    return 0 if ok else 1


def _run_job(trainer: str, args: argparse.Namespace, daemon: DaemonProcess, env: dict[str, str]) -> dict[str, Any]:
    work = daemon.root
    ckpt = work / f"ckpt-{trainer}"
    if trainer == "example":
        job = ["-m", "gpuwatch.examples.trainer", "--steps", str(args.steps), "--ckpt-dir", str(ckpt)]
        job += ["--step-sleep", "0.02", "--report-interval", "1", "--allow-drills", "--ckpt-every", "200"]
    else:
        job = [str(REPO / "tests/hardware/readme_trainer.py"), "--steps", str(args.steps), "--ckpt-dir", str(ckpt)]
    argv = [*daemon.command("launch", "--runtime-dir", str(daemon.runtime_dir), "--max-restarts", "6"), "--", *job]
    started = time.time()
    launch = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=open(work / f"launch-{trainer}.log", "w"), text=True
    )
    out: dict[str, Any] = {"trainer": trainer, "drills": [], "ok": False}
    try:
        for drill in args.drills.split(","):
            gpu = "0" if drill == "fault_rank" else "1"
            floor = _furthest(daemon) + args.warmup
            wait_until(f"both ranks past step {floor}", lambda floor=floor: _both_past(daemon, floor, launch), 240, 0.2)
            cmd = daemon.command("drill", f"--{drill.replace('_', '-')}", gpu, "--yes", "--json")
            t0 = time.time()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
            verdict = last_json(done.stdout)
            out["drills"].append(
                {
                    "drill": drill,
                    "rc": done.returncode,
                    "wall_s": round(time.time() - t0, 1),
                    "verdict": verdict,
                    "stderr": done.stderr[-1500:],
                }
            )
        stdout, _ = launch.communicate(timeout=400)
        out["launch_rc"] = launch.returncode
        out["summary"] = last_json(stdout)
        out["ok"] = launch.returncode == 0 and all(d["rc"] == 0 for d in out["drills"])
    except Exception as exc:  # report what happened, then stop the job
        out["error"] = f"{type(exc).__name__}: {exc}"
        launch.terminate()
        launch.wait(60)
    out["wall_s"] = round(time.time() - started, 1)
    log = (work / f"launch-{trainer}.log").read_text()
    out["launch_lines"] = [
        line for line in log.splitlines() if line.startswith("gpuwatch launch") or "rescued" in line or "resum" in line
    ][-40:]
    return out


def _furthest(daemon: DaemonProcess) -> int:
    return max((r.get("step") or 0 for r in daemon.trainer_reports() if r.get("ended") is None), default=0)


def _both_past(daemon: DaemonProcess, floor: int, launch: subprocess.Popen[str]) -> bool:
    if launch.poll() is not None:
        raise RuntimeError(f"the launcher exited {launch.returncode}")
    running = [r for r in daemon.trainer_reports() if r.get("ended") is None and (r.get("step") or 0) >= floor]
    return len(running) >= 2


def _save(results: dict[str, Any], path: str) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
