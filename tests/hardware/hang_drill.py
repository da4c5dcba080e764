#!/usr/bin/env python3
"""The hang drill on one GPU with the daemon's default config: freeze → hang found → the job's next step.

    python tests/hardware/hang_drill.py --backend nvml --out hang.json             # one H200, relaunch
    python tests/hardware/hang_drill.py --backend nvml --spares --gib 1 --out s.json  # one H200, a warm spare
    python tests/hardware/hang_drill.py --backend sim [--spares --gib 0.05]         # the same chain on the CPU

A `gpuwatch run` with no config beyond its directories (trainer.* and interval_s at their defaults), a
one-rank job on GPU 0 and, once it is past --warmup steps, `gpuwatch drill --hang-rank 0 --yes --json`
(SIGSTOP). The daemon's hang rule finds the stopped rank and SIGKILLs it. Without --spares the job is
the shipped example trainer under `gpuwatch launch` and comes back through the relaunch; with --spares
it is a `gpuwatch.examples.sharded_worker` (a host snapshot every 5 steps) under `gpuwatch launch
--in-place --spares 1` (on a GPU its spare holds its CUDA context: trainer.spare_cuda_context, set for
the launch alone), and the spare takes the rank over from the host snapshot. Prints, as one JSON
document: the drill's verdict and its steps' durations, freeze → next step (with --spares from the
job's own step log, with the steps redone) and the daemon's trainer_hang incident.
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

from gpuwatch.testing.daemon_process import DaemonProcess, child_env, last_json, wait_until

EVERY = 5  # the spare job's snapshot cadence


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    parser.add_argument("--spares", action="store_true", help="one warm spare under --in-place takes the rank over")
    parser.add_argument("--gib", type=float, default=1.0, help="with --spares: the rank's frozen state (GiB)")
    parser.add_argument("--steps", type=int, default=100_000, help="without --spares: the example's steps")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # `timeout` ends the run: the job and daemon go too
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-hang-drill-"))
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    sim = ["--sim-gpus", "1", "--sim-scenario", "healthy"] if args.backend == "sim" else []
    daemon = DaemonProcess(work, *sim, backend=args.backend)
    result: dict[str, Any] = {"backend": args.backend, "config": "defaults", "spares": args.spares}
    launch: subprocess.Popen[str] | None = None
    logs = work / "steps"
    try:
        daemon.start()
        launch_args = ["launch", "--runtime-dir", str(daemon.runtime_dir)]
        if args.spares:
            result.update(state_gib=args.gib, every=EVERY)
            job = ["-m", "gpuwatch.examples.sharded_worker", "--log-dir", str(logs), "--every", str(EVERY)]
            job += ["--state-bytes", str(int(args.gib * (1 << 30))), "--step-sleep", "0.05"]
            launch_args += ["--in-place", "--spares", "1"]
            if args.backend == "nvml":
                env = {**env, "GPUWATCH_TRAINER_SPARE_CUDA_CONTEXT": "true"}
        else:
            job = ["-m", "gpuwatch.examples.trainer", "--steps", str(args.steps), "--ckpt-dir", str(work / "ckpt")]
            job += ["--step-sleep", "0.02", "--ckpt-every", "200"]
            launch_args += ["--max-restarts", "3"]
        log = open(work / "launch.log", "w")  # noqa: SIM115  # the launcher's, for as long as it runs
        launch = subprocess.Popen(
            [*daemon.command(*launch_args), "--", *job], env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        step = (lambda: _furthest(logs)) if args.spares else (lambda: _step(daemon))
        wait_until(f"the job past step {args.warmup}", lambda: step() >= args.warmup, 240, 0.2)
        if args.spares:
            wait_until("a warm spare", spare_warm, 120, 0.2)
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
        if args.spares:
            result.update(_from_the_log(logs, started))
        elif steps.get("hang_found") is not None and steps.get("job_resumed") is not None:
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


def _lines(logs: Path) -> list[dict[str, Any]]:
    found = []
    for path in logs.glob("steps.*.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return found


def _furthest(logs: Path) -> int:
    return max((ln["step"] for ln in _lines(logs)), default=0)


def _from_the_log(logs: Path, frozen: float) -> dict[str, Any]:
    """Freeze → the replacement's first step, and the steps it redid, from the job's own step log."""
    lines = _lines(logs)
    before = [ln for ln in lines if ln["t"] <= frozen]
    victim = max(before, key=lambda ln: ln["t"])["pid"] if before else None
    after = [ln for ln in lines if ln["pid"] != victim and ln["t"] > frozen]
    if victim is None or not after:
        return {"freeze_to_next_step_s": None}
    first = min(after, key=lambda ln: ln["t"])
    last = max(ln["step"] for ln in lines if ln["pid"] == victim)
    return {
        "freeze_to_next_step_s": round(first["t"] - frozen, 3),
        "steps_redone": last - (first["step"] - 1),
        "replacement_spare_warm_s": first.get("spare_warm_s"),
        "replacement_source": (first.get("change") or {}).get("source"),
    }


def spare_warm() -> bool:
    """A spare of this machine has imported torch and said so (it closed its ready pipe)."""
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if b"gpuwatch.spares.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            environ = dict(
                item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
            )
            if b"GPUWATCH_SPARE_NOW" in environ:
                continue  # a rank started under the spare's runner, not a spare
            if not os.path.exists(f"/proc/{pid}/fd/{environ[b'GPUWATCH_SPARE_READY_FD'].decode()}"):
                return True
        except (OSError, KeyError):
            continue
    return False


if __name__ == "__main__":
    sys.exit(main())
