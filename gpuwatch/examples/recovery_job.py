"""The 1-rank job `gpuwatch bench --only recovery` kills: a state of a given size, a fixed step, its own step log.

    python -m gpuwatch.examples.recovery_job --state-gib 4 --ckpt-dir D --step-log L --steps 40 --ckpt-every 10 \\
        [--snapshot-every auto]

The state is parameters and SGD momentum (half each) on the rank's GPU, else the CPU. A step is a
compute phase of --step-s seconds (a GPU spin kernel on CUDA, matrix products on the CPU) and then
the optimizer's update of the whole state. The disk path saves a checkpoint every --ckpt-every steps
in the step (save_checkpoint, as a trainer does); the snapshot path keeps host snapshots and writes
the checkpoint from them in the background. Its log (JSON lines, steplog.py) has a line per launch, with where it
resumed from and how long the restore took, and a line per finished step, with the time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatch.examples.steplog import StepLog

PARTS = 8


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    params, optim = make_state(args.state_gib, device)
    compute = make_compute(device, args.step_s)
    snap = _snapshot(args, params, optim)
    log_path = Path(args.step_log)
    launch = sum(1 for line in log_path.read_text().splitlines() if '"launch"' in line) if log_path.exists() else 0
    log = StepLog(log_path)
    started = time.perf_counter()
    restored = snap.resume(args.ckpt_dir) if snap is not None else None
    if snap is None:
        from gpuwatch.trainer.checkpoint import load_latest

        loaded = load_latest(args.ckpt_dir)
        step, state, source = (loaded.step, loaded.state, "disk") if loaded else (0, None, None)
    else:
        step, state, source = (restored.step, restored.state, restored.source) if restored else (0, None, None)
    if state is not None:
        load_state(params, optim, state)
    if device.type == "cuda":
        torch.cuda.synchronize()
    restore_s = time.perf_counter() - started
    log.write(launch=launch, resumed_from=step, source=source, restore_s=restore_s, pid=os.getpid())
    while step < args.steps:
        compute()
        optim.step()
        step += 1
        if snap is not None:
            snap.step(step)
        if step % args.ckpt_every == 0:
            if snap is not None:
                snap.checkpoint(args.ckpt_dir, step, keep=1)
            else:
                from gpuwatch.trainer.checkpoint import save_checkpoint

                save_checkpoint(args.ckpt_dir, step, state_of(params, optim), keep=1)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step is finished when the GPU finished it
        log.write(step=step)
    if snap is not None:
        log.write(snapshot=snap.stats())
        snap.close(remove=True)
    return 0


def make_state(gib: float, device: Any) -> tuple[list[Any], Any]:
    """Parameters of gib/2 GiB (with gradients) and SGD with momentum, whose buffers make the other half."""
    import torch

    numel = max(PARTS, int(gib * 2**30 / 2 / 4)) // PARTS
    generator = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(numel, device=device, generator=generator) for _ in range(PARTS)]
    params = [torch.nn.Parameter(p) for p in params]
    for p in params:
        p.grad = torch.full_like(p, 1e-6)
    optim = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    optim.step()  # the momentum buffers exist from here: the state is its full size
    return params, optim


def state_of(params: list[Any], optim: Any) -> dict[str, Any]:
    return {"params": [p.detach() for p in params], "optim": optim.state_dict()}


def load_state(params: list[Any], optim: Any, state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for p, saved in zip(params, state["params"], strict=True):
            p.copy_(saved)
    optim.load_state_dict(state["optim"])


def make_compute(device: Any, seconds: float) -> Any:
    """The step's compute phase: about `seconds` of GPU time (a spin kernel), or of CPU matrix products."""
    import torch

    if device.type == "cuda":
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        probe = 10_000_000
        begin = time.perf_counter()
        torch.cuda._sleep(probe)
        torch.cuda.synchronize()
        cycles = int(probe * seconds / max(time.perf_counter() - begin, 1e-6))
        return lambda: torch.cuda._sleep(cycles)
    a = torch.randn(256, 256)

    def cpu() -> None:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            a @ a

    return cpu


def _snapshot(args: argparse.Namespace, params: list[Any], optim: Any) -> Any:
    if args.snapshot_every is None:
        return None
    from gpuwatch.snapshots import HostSnapshot

    job_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("GPUWATCH_JOB_ID") or f"bench-{os.getpid()}"
    return HostSnapshot(lambda: state_of(params, optim), every=args.snapshot_every, optimizer=optim,
                        replicated=True, job_id=job_id)  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    prog, description = "python -m gpuwatch.examples.recovery_job", __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--state-gib", type=float, required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt-every", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--snapshot-every", default=None)
    args = parser.parse_args(argv)
    if not (args.state_gib > 0 and args.steps > 0 and args.ckpt_every > 0 and args.step_s >= 0):
        parser.error("--state-gib, --steps and --ckpt-every must be positive, --step-s not negative")
    return args


if __name__ == "__main__":
    sys.exit(main())
