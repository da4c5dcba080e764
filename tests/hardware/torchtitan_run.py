#!/usr/bin/env python3
"""torchtitan's debug model under `gpuwatch launch` with gpuwatch's one config line: a fault, the resume, steps lost.

    python tests/hardware/torchtitan_run.py --device cuda                  # every GPU: SIGKILL of rank 1
    python tests/hardware/torchtitan_run.py --device cuda --fault quarantine
    python tests/hardware/torchtitan_run.py --device cuda --nproc 1        # one GPU: SIGKILL of rank 0
    python tests/hardware/torchtitan_run.py --device cpu --small           # the same measurement, on the CPU
    python tests/hardware/torchtitan_run.py --device cuda --nproc 1 --job hf-fsdp   # HF Trainer + FSDP2, one GPU

On CUDA it starts a daemon (nvml, its own dirs under --workdir), writes the assets torchtitan's
debug config reads from its working directory (`tests/assets/tokenizer`: a byte-level BPE tokenizer
trained here; `tests/assets/c4_test`: generated text), and runs

    gpuwatch launch -- -m torchtitan.train --module gpuwatch.frameworks.torchtitan --config llama3_debugmodel
        --checkpoint.enable --checkpoint.interval 50 --training.steps 300 --metrics.log_freq 1 ...

Once every rank passed --fault-at it SIGKILLs the last rank (rank 1; rank 0 with --nproc 1) or
quarantines its GPU through the daemon (then releases it at the end), waits for `gpuwatch launch`
to relaunch the job and for the job to finish, and reads the steps from torchtitan's own log lines
("step: N"): the furthest step before the fault, the step the relaunch resumed from, the steps
lost; and the daemon's incident. What counts as a pass: a quarantine loses 0 steps (every rank
stops at one step, torchtitan saves it); a kill resumes from the newest checkpoint (torchtitan's
state is sharded: no survivor can save it alone, so the steps since --ckpt-every's last save are
lost; with --nproc 1 there is no survivor at all). A quarantine needs a second usable GPU for the
relaunch, so with --nproc 1 it needs a machine of two GPUs or more. The whole run is bounded by
--deadline (default 280 s; 600 s on a loaded CPU). torchtitan cannot run on a CPU (it calls CUDA's set-device),
so `--device cpu --small` measures the same way a Hugging Face Trainer job (tests/frameworks/hf_train.py,
2 gloo ranks, the sim daemon): it checks this script, not torchtitan. It prints one JSON object,
then a markdown table. Nothing on the GPUs is changed (the quarantine is the daemon's own record).

`--job hf-fsdp` runs tests/frameworks/hf_train.py with FSDP2 through accelerate (`fsdp_config
{"fsdp_version": 2}`) on the GPUs instead: accelerate applies FSDP only on accelerators (on the CPU
the same arguments train with DDP), so this is where HF's FSDP path with gpuwatch's callback runs.
Its kill resumes from HF's last (sharded, sealed) checkpoint: FSDP state has no survivor's rescue.

What the GPU machine needs beside gpuwatch's own: torchtitan 0.3.0 and what it pulls in for
python 3.12 (torchdata, torch_checkpointing, datasets<4.8, tokenizers, safetensors, tyro,
tensorboard, wandb, einops, pillow, spmd_types==0.2.3, and their dependencies), as wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuwatch.testing.daemon_process import DaemonProcess, child_env

REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"\bstep:\s*(\d+)\b")  # torchtitan's metrics line: "step:  12  loss: ..."
HF_STEP_LINE = re.compile(r"^step (\d+) (\d+)$")  # tests/frameworks/hf_train.py's step log
JOB_NAMES = {
    "torchtitan": "torchtitan llama3_debugmodel",
    "hf": "HF Trainer, hf_train.py (DDP)",
    "hf-fsdp": "HF Trainer, hf_train.py (FSDP2 through accelerate)",
}
LAUNCH_LINE = re.compile(r"^gpuwatch launch: launch \d+ \(")  # each torchrun run of the launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="fewer steps (the CPU run)")
    parser.add_argument("--fault", choices=("kill", "quarantine"), default="kill")
    parser.add_argument("--steps", type=int, default=300, help="enough for the fault to land mid-run")
    parser.add_argument("--fault-at", type=int, default=70)
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--job", choices=("torchtitan", "hf", "hf-fsdp"), help="default: torchtitan, hf on the CPU")
    parser.add_argument("--deadline", type=float, help="seconds for the whole run; default 280, 600 on the CPU")
    parser.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()
    args.job = args.job or ("torchtitan" if args.device == "cuda" else "hf")
    if args.job != "hf" and args.device == "cpu":
        parser.error(f"--job {args.job} needs --device cuda (it cannot run on a CPU: see the docstring)")
    args.deadline = args.deadline or (280.0 if args.device == "cuda" else 600.0)
    if args.small:
        args.steps, args.fault_at = 110, 70

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpuwatch-torchtitan-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**child_env(("GPUWATCH_", "TORCHELASTIC_")), "PYTHONPATH": str(REPO)}
    sim = ["--sim-gpus", "2", "--sim-scenario", "healthy"] if args.device == "cpu" else []
    backend = "sim" if args.device == "cpu" else "nvml"
    with DaemonProcess(work, "--interval", "1", *sim, backend=backend) as daemon:
        job = _torchtitan_job(work, args) if args.job == "torchtitan" else _hf_job(work, args)
        command = daemon.command("launch", "--runtime-dir", str(daemon.runtime_dir), "--max-restarts", "2")
        log_path = work / "launch.log"
        started = time.time()
        launch = subprocess.Popen(
            [*command, "--nproc-per-node", str(args.nproc), "--", *job],
            env=env,
            cwd=work,
            stdout=open(log_path, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + args.deadline
        ranks = _wait_for_ranks(daemon, launch, args.fault_at, args.nproc, deadline)
        victim = ranks[max(ranks)]  # rank 1, or rank 0 of a one-rank job
        fault_t = time.time()
        if args.fault == "kill":
            os.kill(victim["pid"], signal.SIGKILL)
        else:
            subprocess.run(daemon.command("quarantine", str(victim["gpu"]), "--reason", "torchtitan_run"), check=True)
        try:
            rc = launch.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            launch.kill()
            rc = launch.wait()
            print(f"gpuwatch launch did not finish within --deadline {args.deadline:.0f} s: killed", file=sys.stderr)
        incidents = daemon.get("/v1/incidents")["incidents"]
        if args.fault == "quarantine":
            subprocess.run(daemon.command("release", str(ranks[1]["gpu"])), check=False)
    text = log_path.read_text(errors="replace")
    first_launch, second = _steps(text, work, args.job)
    incident = incidents[0] if incidents else {}
    furthest = max(first_launch) if first_launch else None
    survivor_saves = args.fault == "quarantine" or (args.job == "hf" and args.nproc > 1)  # HF's rescue (DDP)
    expected = furthest if survivor_saves or furthest is None else furthest // args.ckpt_every * args.ckpt_every
    result = {
        "framework": JOB_NAMES[args.job],
        "device": args.device,
        "fault": args.fault,
        "nproc": args.nproc,
        "victim_rank": victim["rank"],
        "fault_at_step": furthest,
        "expected_resume": expected,
        "resumed_from": min(second) - 1 if second else None,
        "steps_lost": (max(first_launch) - (min(second) - 1)) if first_launch and second else None,
        "incident_kind": incident.get("kind"),
        "incident_steps_lost": incident.get("steps_lost"),
        "fault_to_resumed_s": incident.get("time_to_resume_s"),
        "wall_s": round(time.time() - started, 1),
        "launch_rc": rc,
        "fault_t": fault_t,
        "workdir": str(work),
    }
    print(json.dumps(result), flush=True)
    print("| framework | fault | fault at step | resumed from | steps lost (job's log) | daemon's steps_lost |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| {result['framework']} | {args.fault} | {result['fault_at_step']} | {result['resumed_from']} "
        f"| {result['steps_lost']} | {result['incident_steps_lost']} |"
    )
    for line in text.splitlines():
        if line.startswith("gpuwatch launch:") or "gpuwatch:" in line or "skipped checkpoint" in line:
            print(line)
    return 0 if rc == 0 and result["resumed_from"] == expected else 1


def _torchtitan_job(work: Path, args: argparse.Namespace) -> list[str]:
    _write_assets(work / "tests" / "assets")
    return [
        "-m", "torchtitan.train", "--module", "gpuwatch.frameworks.torchtitan", "--config", "llama3_debugmodel",
        "--dump_folder", str(work / "outputs"), "--training.steps", str(args.steps),
        "--checkpoint.enable", "--checkpoint.interval", str(args.ckpt_every),
        "--validator.no-enable", "--profiler.no-enable-profiling", "--metrics.log_freq", "1",
    ]  # fmt: skip


def _hf_job(work: Path, args: argparse.Namespace) -> list[str]:
    out = work / "out"
    script = REPO / "tests" / "frameworks" / "hf_train.py"
    devices = ["--cuda"] if args.device == "cuda" else []
    fsdp = ["--fsdp"] if args.job == "hf-fsdp" else []
    return [str(script), "--out", str(out), "--log", str(work / "steps"), "--steps", str(args.steps),
            "--save-steps", str(args.ckpt_every), "--step-sleep", "0.05", *devices, *fsdp]  # fmt: skip


def _write_assets(assets: Path) -> None:
    """What llama3_debugmodel reads from ./tests/assets: a tokenizer (trained here) and the c4_test text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [f"w{i % 97}x{i % 13}" for i in range(5000)]
    lines = [" ".join(words[i : i + 300]) for i in range(0, len(words), 50)]
    (assets / "c4_test").mkdir(parents=True, exist_ok=True)
    with open(assets / "c4_test" / "data.json", "w") as f:
        for line in lines * 40:
            f.write(json.dumps({"text": line}) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1000, special_tokens=special))
    (assets / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(assets / "tokenizer" / "tokenizer.json"))
    config = {"bos_token": special[0], "eos_token": special[1], "tokenizer_class": "PreTrainedTokenizerFast"}
    (assets / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))


def _wait_for_ranks(
    daemon: DaemonProcess, launch: subprocess.Popen[str], step: int, nproc: int, deadline: float
) -> dict[int, dict[str, Any]]:
    while time.monotonic() < deadline:
        live = {r["rank"]: r for r in daemon.trainer_reports() if r.get("ended") is None}
        if len(live) >= nproc and all((r.get("step") or 0) >= step for r in live.values()):
            return live
        if launch.poll() is not None:
            raise SystemExit(f"gpuwatch launch exited {launch.returncode} before step {step}: see its log")
        time.sleep(0.05)
    launch.kill()
    raise SystemExit(f"the ranks did not reach step {step} within --deadline: see its log")


def _steps(text: str, work: Path, job: str) -> tuple[list[int], list[int]]:
    """The steps each of the first two launches finished, from the job's own log."""
    launches: list[list[int]] = []
    if job != "torchtitan":
        by_pid: dict[str, list[int]] = {}
        for line in (work / "steps.rank0").read_text().splitlines():
            match = HF_STEP_LINE.match(line)
            if match:
                by_pid.setdefault(match.group(1), []).append(int(match.group(2)))
        launches = list(by_pid.values())
    else:
        for line in text.splitlines():
            if LAUNCH_LINE.match(line):
                launches.append([])
            match = STEP_LINE.search(line)
            if match and launches and "[default0]" in line:
                launches[-1].append(int(match.group(1)))
    launches = [steps for steps in launches if steps]
    return (launches[0] if launches else []), (launches[1] if len(launches) > 1 else [])


if __name__ == "__main__":
    sys.exit(main())
