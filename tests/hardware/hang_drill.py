#!/usr/bin/env python3
"""The hang drill on one GPU with the daemon's default config: freeze → hang found → the job's next step.

    python tests/hardware/hang_drill.py --backend nvml --out hang.json   # one H200
    python tests/hardware/hang_drill.py --backend sim                    # the same chain on the CPU

A `gpuwatch run` with no config beyond its directories (trainer.* and interval_s at their defaults),
the shipped example trainer under `gpuwatch launch` on GPU 0, and, once it is past --warmup steps,
`gpuwatch drill --hang-rank 0 --yes --json` (SIGSTOP). Prints the drill's verdict, each step's
duration, freeze → next step, and the daemon's trainer_hang incident as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuwatch.bench.daemon_process import DaemonProcess, child_env, last_json, wait_until


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # `timeout` ends the run: the job and daemon go too
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-hang-drill-"))
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    sim = ["--sim-gpus", "1", "--sim-scenario", "healthy"] if args.backend == "sim" else []
    daemon = DaemonProcess(work, *sim, backend=args.backend)
    result: dict[str, Any] = {"backend": args.backend, "config": "defaults"}
    launch: subprocess.Popen[str] | None = None
    try:
        daemon.start()
        job = ["-m", "gpuwatch.examples.trainer", "--steps", str(args.steps), "--ckpt-dir", str(work / "ckpt")]
        job += ["--step-sleep", "0.02", "--ckpt-every", "200"]
        argv = [*daemon.command("launch", "--runtime-dir", str(daemon.runtime_dir), "--max-restarts", "3"), "--", *job]
        log = open(work / "launch.log", "w")  # noqa: SIM115  # the launcher's, for as long as it runs
        launch = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        wait_until(f"the job past step {args.warmup}", lambda: _step(daemon) >= args.warmup, 240, 0.2)
        # The daemon lists a GPU's trainers at its next sample: up to interval_s (30 s by default).
        wait_until("the rank listed on GPU 0", lambda: bool(daemon.get("/v1/gpus/0").get("trainers")), 90, 0.5)
        started = time.time()
        done = subprocess.run(
            daemon.command("drill", "--hang-rank", "0", "--yes", "--json"),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        verdict = last_json(done.stdout)
        result.update(drill_rc=done.returncode, drill_wall_s=round(time.time() - started, 2), verdict=verdict)
        steps = {s["name"]: s.get("duration_s") for s in (verdict or {}).get("steps", [])}
        result["step_durations_s"] = steps
        if steps.get("hang_found") is not None and steps.get("job_resumed") is not None:
            result["freeze_to_next_step_s"] = round(steps["hang_found"] + steps["job_resumed"], 2)
        result["incidents"] = [
            i for i in daemon.get("/v1/incidents?limit=20")["incidents"] if i.get("kind") == "trainer_hang"
        ]
        result["stderr"] = done.stderr[-1500:]
    finally:
        if launch is not None:
            launch.terminate()
            try:
                launch.wait(60)
            except subprocess.TimeoutExpired:
                launch.kill()
        daemon.stop()
        result["daemon_log_tail"] = daemon.log_text()[-3000:]
        result["launch_log_tail"] = (work / "launch.log").read_text()[-3000:] if (work / "launch.log").exists() else ""
        text = json.dumps(result, indent=1)
        if args.out:
            Path(args.out).write_text(text)
        print(text)
    return 0 if result.get("drill_rc") == 0 else 1


def _step(daemon: DaemonProcess) -> int:
    return max((r.get("step") or 0 for r in daemon.trainer_reports() if r.get("ended") is None), default=0)


if __name__ == "__main__":
    sys.exit(main())
