#!/usr/bin/env python3
"""A single-rank job's faults as the daemon and the drills count them, against the job's own step log.

    python tests/hardware/trust_run.py --backend nvml --out trust.json            # one H200
    python tests/hardware/trust_run.py --backend sim --drills kill_rank,hang_rank # the same chain on the CPU

A one-rank example job under `gpuwatch launch` (checkpoints every 50 steps, so a fault with no
survivor redoes the steps since the last one) meets kill_rank, hang_rank and fault_rank (a real XID
31 in its own CUDA context), one after the other. For each drill it prints the drill's verdict, the
daemon's incident (kind, steps lost, when the fault began, when the job took its next step) and the
job's own count: progress.json, which rank 0 rewrites at every step, gives each launch's furthest
step and the step the next launch resumed from. Then, within ten minutes of the XID 31, the daemon
is restarted (SIGTERM, start again) while the job runs: the kernel log it replays holds that XID,
and the job must get no signal and open no incident. Exit 0 when every figure agrees.
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

HANG_IN_SECONDS = {"GPUWATCH_TRAINER_HANG_AFTER_S": "10", "GPUWATCH_TRAINER_STALE_AFTER_S": "5"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    parser.add_argument("--drills", default="kill_rank,hang_rank,fault_rank")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=73, help="steps between drills (not a multiple of 50)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-trust-"))
    sim = ["--sim-gpus", "1", "--sim-scenario", "healthy"] if args.backend == "sim" else []
    daemon = DaemonProcess(work, "--interval", "1", *sim, backend=args.backend, env=HANG_IN_SECONDS)
    env = {**child_env(("GPUWATCH_", "TORCHELASTIC_")), **HANG_IN_SECONDS}
    ckpt = work / "ckpt"
    job = ["-m", "gpuwatch.examples.trainer", "--steps", str(args.steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "50"]
    job += ["--step-sleep", "0.02", "--report-interval", "1", "--allow-drills", "--no-rescue"]
    result: dict[str, Any] = {"backend": args.backend, "drills": [], "ok": False}
    launch = None
    try:
        daemon.start()
        argv = [*daemon.command("launch", "--runtime-dir", str(daemon.runtime_dir), "--max-restarts", "8")]
        argv += ["--nproc-per-node", "1", "--", *job]
        launch = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=open(work / "launch.log", "w"))
        for drill in args.drills.split(","):
            result["drills"].append(_drill(drill, daemon, launch, ckpt, args.warmup))
            _save(result, args.out)
        result["restart"] = _restart(daemon, launch, ckpt, args.warmup)
        result["ok"] = all(d["agrees"] for d in result["drills"]) and result["restart"]["quiet"]
    except Exception as exc:  # say what happened, then stop the job
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if launch is not None:
            launch.terminate()
            launch.wait(60)
        daemon.stop()
        result["launch_lines"] = [
            line for line in (work / "launch.log").read_text().splitlines() if line.startswith("gpuwatch launch")
        ][-30:]
        result["progress"] = _launches(ckpt)
        _save(result, args.out)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def _drill(
    drill: str, daemon: DaemonProcess, launch: subprocess.Popen[bytes], ckpt: Path, warmup: int
) -> dict[str, Any]:
    floor = _furthest(ckpt) + warmup
    wait_until(f"the job past step {floor}", lambda: _running(launch) and _furthest(ckpt) >= floor, 300, 0.1)
    before = len(_launches(ckpt))
    started = time.time()
    cmd = daemon.command("drill", f"--{drill.replace('_', '-')}", "0", "--yes", "--json")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    verdict = last_json(done.stdout) or {}
    wait_until("the relaunch's first step", lambda: len(_launches(ckpt)) > before, 120, 0.1)
    launches = _launches(ckpt)
    own_lost = launches[before - 1]["furthest"] - (launches[before]["resumed_from"] or 0)
    incident = next(
        (i for i in daemon.get("/v1/incidents?limit=20")["incidents"] if i["t"] >= started - 1 and i.get("ranks")), {}
    )
    figures = {k: incident.get(k) for k in ("kind", "path", "reason", "last_step", "resumed_step", "steps_lost")}
    figures |= {k: incident.get(k) for k in ("began_t", "detected_t", "stopped_t", "next_step_t", "time_to_resume_s")}
    return {
        "drill": drill,
        "rc": done.returncode,
        "verdict_last_step": (verdict.get("steps") or [{}])[-1].get("detail"),
        "incident": figures,
        "job_log": {"furthest": launches[before - 1]["furthest"], "resumed_from": launches[before]["resumed_from"]},
        "job_log_steps_lost": own_lost,
        "agrees": done.returncode == 0 and incident.get("steps_lost") == own_lost,
    }


def _restart(daemon: DaemonProcess, launch: subprocess.Popen[bytes], ckpt: Path, warmup: int) -> dict[str, Any]:
    """Restart the daemon while the job runs, within ten minutes of the XID 31: nothing may happen to the job."""
    floor = _furthest(ckpt) + warmup
    wait_until(f"the job past step {floor}", lambda: _running(launch) and _furthest(ckpt) >= floor, 300, 0.1)
    launches = len(_launches(ckpt))
    incidents = {i["id"] for i in daemon.get("/v1/incidents?limit=100")["incidents"]}
    (daemon.root / "daemon-before-restart.log").write_text(daemon.log_text())
    daemon.stop()
    daemon.start()
    time.sleep(15.0)  # fifteen samples at 1 s, the kernel log replayed
    new = [i for i in daemon.get("/v1/incidents?limit=100")["incidents"] if i["id"] not in incidents]
    replayed = [x for g in daemon.get("/v1/gpus")["gpus"] for x in g.get("kernel_xids", [])]
    return {
        "new_incidents": new,
        "relaunches_since": len(_launches(ckpt)) - launches,
        "kernel_xids_replayed": [(x["xid"], round(time.time() - x["t"], 1)) for x in replayed],
        "quiet": not new and len(_launches(ckpt)) == launches and _running(launch),
    }


def _launches(ckpt: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads((ckpt / "progress.json").read_text())["launches"])
    except (OSError, ValueError, KeyError):
        return []


def _furthest(ckpt: Path) -> int:
    launches = _launches(ckpt)
    return int(launches[-1]["furthest"]) if launches else 0


def _running(launch: subprocess.Popen[bytes]) -> bool:
    if launch.poll() is not None:
        raise RuntimeError(f"gpuwatch launch exited {launch.returncode}")
    return True


def _save(result: dict[str, Any], path: str) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
