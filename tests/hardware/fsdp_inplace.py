#!/usr/bin/env python3
"""A one-rank FSDP2 job recovers in place through a warm spare: SIGKILL → the job's next step, from its own log.

    python -m tests.hardware.fsdp_inplace --device cuda --gib 16 --out fsdp.json   # one GPU, nvml daemon (~2-4 min)
    python -m tests.hardware.fsdp_inplace --device cpu --small                      # the same chain on the CPU, sim

(from the checkout's root: it imports tests.hardware.hang_drill). A `gpuwatch run` (nvml on cuda, a
1-GPU sim on cpu) and `gpuwatch launch --in-place --spares 1` running `gpuwatch.examples.fsdp_worker`
(an MLP under `fully_shard`, AdamW, a host snapshot every 5 steps) sized so that its state
(parameters and AdamW's two moments, fp32) is --gib; the model is built on the CPU with torch's
default init and moved to the GPU, as users do. On a GPU the spare holds its CUDA context
(trainer.spare_cuda_context, for this launch alone). Once the job is past --warmup steps and the spare
is warm, the rank is SIGKILLed; the spare takes the rank, builds the model on the meta device, and
restores its shards from the host snapshot onto the GPU. Prints one JSON document and one markdown
row: kill → the replacement's first step (from the loop's own log), the steps redone (at most 5), and
where the replacement's state came from ("memory": the host snapshot; nothing is read from disk).
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

from gpuwatch.testing.daemon_process import DaemonProcess, child_env, wait_until
from tests.hardware.hang_drill import _furthest, _lines, spare_warm

EVERY = 5
WIDTH = 4096  # one block: Linear(W, 2W) and Linear(2W, W), 4 W^2 parameters
BYTES_PER_PARAMETER = 12  # fp32 parameter + AdamW's exp_avg and exp_avg_sq


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gib", type=float, default=16.0, help="the rank's training state (GiB)")
    parser.add_argument("--small", action="store_true", help="a CPU-sized model (width 256, 2 blocks)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # `timeout` ends the run: the job and daemon go too
    width = 256 if args.small else WIDTH
    layers = 2 if args.small else max(1, round(args.gib * (1 << 30) / (BYTES_PER_PARAMETER * 4 * width * width)))
    state_gib = layers * (4 * width * width + 3 * width) * BYTES_PER_PARAMETER / (1 << 30)
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-fsdp-inplace-"))
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    backend = "nvml" if args.device == "cuda" else "sim"
    sim = [] if backend == "nvml" else ["--sim-gpus", "1", "--sim-scenario", "healthy"]
    daemon = DaemonProcess(work, *sim, backend=backend)
    result: dict[str, Any] = {"device": args.device, "state_gib": round(state_gib, 2), "every": EVERY}
    result.update(width=width, layers=layers)
    logs = work / "steps"
    job = ["-m", "gpuwatch.examples.fsdp_worker", "--log-dir", str(logs), "--every", str(EVERY)]
    job += ["--width", str(width), "--layers", str(layers), "--step-sleep", "0.05", "--no-checksum"]
    job += ["--backend", "nccl" if args.device == "cuda" else "gloo"]
    if args.device == "cuda":
        env["GPUWATCH_TRAINER_SPARE_CUDA_CONTEXT"] = "true"
    launch: subprocess.Popen[str] | None = None
    try:
        daemon.start()
        log = open(work / "launch.log", "w")  # noqa: SIM115  # the launcher's, for as long as it runs
        command = daemon.command("launch", "--runtime-dir", str(daemon.runtime_dir), "--in-place", "--spares", "1")
        launch = subprocess.Popen([*command, "--", *job], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        wait_until(f"the job past step {args.warmup}", lambda: _furthest(logs) >= args.warmup, 240, 0.2)
        wait_until("a warm spare", spare_warm, 120, 0.2)
        now = _furthest(logs)  # kill one step short of a snapshot: the most a kill can cost (K - 1 redone)
        wait_until("a step just short of a snapshot", lambda: _short_of_snapshot(logs, now), 60, 0.01)
        victim = max(_lines(logs), key=lambda ln: ln["t"])["pid"]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_until("the replacement's first step", lambda: bool(_after(logs, victim, killed)), 180, 0.05)
        result.update(_figure(logs, victim, killed))
    finally:
        if launch is not None:
            launch.terminate()
            try:
                launch.wait(60)
            except subprocess.TimeoutExpired:
                launch.kill()
        daemon.stop()
        result["launch_log_tail"] = (work / "launch.log").read_text()[-3000:] if (work / "launch.log").exists() else ""
        text = json.dumps(result, indent=1)
        if args.out:
            Path(args.out).write_text(text)
        print(text)
    if result.get("kill_to_next_step_s") is None:
        return 1
    print("\n| job | state | kill → next step | steps redone | state from |\n| --- | --- | --- | --- | --- |")
    print(f"| FSDP2, one rank, {args.device} | {result['state_gib']} GiB | {result['kill_to_next_step_s']} s"
          f" | {result['steps_redone']} | {result['replacement_source']} |")  # fmt: skip
    return 0


def _short_of_snapshot(logs: Path, past: int) -> bool:
    return any(ln["step"] > past and ln["step"] % EVERY == EVERY - 1 for ln in _lines(logs))


def _after(logs: Path, victim: int, killed: float) -> list[dict[str, Any]]:
    return [ln for ln in _lines(logs) if ln["pid"] != victim and ln["t"] > killed]


def _figure(logs: Path, victim: int, killed: float) -> dict[str, Any]:
    """Kill → the replacement's first step, and the steps it redid, from the job's own step log."""
    first = min(_after(logs, victim, killed), key=lambda ln: ln["t"])
    last = max(ln["step"] for ln in _lines(logs) if ln["pid"] == victim)
    change = first.get("change") or {}
    return {
        "kill_to_next_step_s": round(first["t"] - killed, 3),
        "steps_redone": last - (first["step"] - 1),
        "replacement_source": change.get("source"),
        "replacement_change_s": change.get("seconds"),
        "replacement_first_step": first["step"],
        "victim_last_step": last,
    }


if __name__ == "__main__":
    sys.exit(main())
