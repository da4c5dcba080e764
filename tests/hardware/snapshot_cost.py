"""What host snapshots cost a real training loop, from the loop's own step log (run on a GPU machine).

    python tests/hardware/snapshot_cost.py --gib 4 16 --steps 200 [--kill-gib 16]

Per state size: fp32 weights + AdamW (a stack of square linear layers; state = weights and both
moments), the batch sized so a step takes --step-ms (20 ms per 4 GiB of state by default). Each
loop logs its own step wall times (loss.item() every step). Runs, in order: no snapshots, snapshots
every --every steps, every="auto", no snapshots again; the warm-up runs until the slots are set up
and a first snapshot committed, then --steps steps are timed. Printed: the wall time of each run,
the overhead against the mean of the two runs without, the largest step after the warm-up, the
mode, the drain, K and what stats() says.

--kill-gib: a child process trains with snapshots every --every steps and logs each step; it is
SIGKILLed mid-run, and a second child restores: seconds from its CUDA context to the state on the
GPU, and steps lost (the last step the first child logged minus the restored step).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WIDTH = 8192


def build(gib: float, device: Any, batch: int) -> tuple[Any, Any, Any]:
    import torch

    width = int(os.environ.get("SNAPSHOT_COST_WIDTH", WIDTH))
    layers = max(1, round(gib * 2**30 / (12 * width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(batch, width, device=device)
    return model, optim, x


def state_of(model: Any, optim: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def train_step(model: Any, optim: Any, x: Any) -> float:
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.item())


def calibrate(gib: float, device: Any, step_s: float) -> int:
    """The batch for which a step takes about step_s (two batch sizes, a straight line)."""
    import torch

    times = {}
    for batch in (256, 1024):
        model, optim, x = build(gib, device, batch)
        for _ in range(3):
            train_step(model, optim, x)
        started = time.perf_counter()
        for _ in range(8):
            train_step(model, optim, x)
        times[batch] = (time.perf_counter() - started) / 8
        del model, optim, x
        torch.cuda.empty_cache() if device.type == "cuda" else None
    slope = (times[1024] - times[256]) / 768
    fixed = times[256] - slope * 256
    return max(16, int((step_s - fixed) / slope)) if slope > 0 else 1024


def run(model: Any, optim: Any, x: Any, steps: int, snap: Any, first: int) -> dict[str, Any]:
    """Warm up (until the slots are set up and a snapshot committed), then time `steps` steps."""
    step, warm = first, []
    deadline = time.perf_counter() + 120
    while True:
        started = time.perf_counter()
        train_step(model, optim, x)
        step += 1
        if snap is not None:
            snap.step(step)
        warm.append(time.perf_counter() - started)
        ready = snap is None or (snap.stats()["snapshots"] >= 1 and snap.every is not None)
        if (ready and len(warm) >= 10) or time.perf_counter() > deadline:
            break
    times = []
    began = time.perf_counter()
    for _ in range(steps):
        started = time.perf_counter()
        train_step(model, optim, x)
        step += 1
        if snap is not None:
            snap.step(step)
        times.append(time.perf_counter() - started)
    wall = time.perf_counter() - began
    slowest = sorted(range(len(warm)), key=lambda i: -warm[i])[:3]
    print(f"   warm-up: slowest steps (index: ms) {[(i, round(warm[i] * 1e3, 1)) for i in slowest]}", flush=True)
    return {"wall_s": wall, "warm_steps": len(warm), "warm_max_s": max(warm), "max_s": max(times),
            "median_s": statistics.median(times), "last_step": step}  # fmt: skip


def sizes(args: argparse.Namespace, device: Any) -> None:
    import torch

    from gpuwatch.snapshots import HostSnapshot

    for gib in args.gib:
        step_s = args.step_ms / 1e3 * gib / 4 if args.step_ms else 0.02 * gib / 4
        batch = calibrate(gib, device, step_s)
        model, optim, x = build(gib, device, batch)
        for _ in range(3):
            train_step(model, optim, x)
        state_gib = sum(t.numel() * t.element_size() for t in _tensors(state_of(model, optim))) / 2**30
        print(f"== {state_gib:.2f} GiB of state, batch {batch}, target step {step_s * 1e3:.0f} ms", flush=True)
        results: dict[str, Any] = {}
        step = 3
        runs = (("none", None), (f"every {args.every}", args.every), ("auto", "auto"), ("none again", None))
        for name, every in runs:
            snap = None
            if every is not None:
                snap = HostSnapshot(functools.partial(state_of, model, optim), every=every, optimizer=optim,
                                    replicated=True, job_id=f"cost-{gib}-{every}")  # fmt: skip
            out = run(model, optim, x, args.steps, snap, step)
            step = out["last_step"]
            if snap is not None:
                snap.wait()
                out["stats"] = {k: v for k, v in snap.stats().items() if k not in ("directory", "disabled_reason")}
                snap.close(remove=True)
            results[name] = out
            print(f"{name:>12}: {args.steps} steps {out['wall_s']:.3f} s, median step {out['median_s'] * 1e3:.2f} ms, "
                  f"max step {out['max_s'] * 1e3:.1f} ms (warm-up: {out['warm_steps']} steps, max "
                  f"{out['warm_max_s'] * 1e3:.1f} ms)", flush=True)  # fmt: skip
            if snap is not None:
                print(f"{'':>12}  stats: {json.dumps(out['stats'])}", flush=True)
        base = (results["none"]["wall_s"] + results["none again"]["wall_s"]) / 2
        for name in (f"every {args.every}", "auto"):
            over = results[name]["wall_s"] / base - 1
            print(f"{state_gib:.2f} GiB {name}: wall {results[name]['wall_s']:.3f} s vs {base:.3f} s without "
                  f"(mean of two runs): {over:+.2%}; K = {results[name]['stats']['every']}", flush=True)  # fmt: skip
        del model, optim, x
        torch.cuda.empty_cache() if device.type == "cuda" else None


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def child(args: argparse.Namespace) -> int:
    """One launch of the killed job: restore if there is a snapshot, then train and log every step."""
    started = time.perf_counter()
    import torch

    from gpuwatch.snapshots import HostSnapshot

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.zeros(1, device=device)
    torch.backends.cuda.matmul.allow_tf32 = True
    context_s = time.perf_counter() - started
    log = Path(args.log).open("a", buffering=1)
    model, optim, x = build(args.kill_gib, device, args.batch)
    train_step(model, optim, x)  # AdamW's state exists (what a restore loads into)
    snap = HostSnapshot(lambda: state_of(model, optim), every=args.every, optimizer=optim, replicated=True,
                        job_id="killed-job")  # fmt: skip
    t0 = time.perf_counter()
    try:
        restored = snap.restore(device=device)
    except Exception as exc:  # the device path failed here: say so, and time the CPU path instead
        print(f"restore(device=cuda) failed: {type(exc).__name__}: {exc}", flush=True)
        t0 = time.perf_counter()
        restored = snap.restore()
    step = 0
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        optim.load_state_dict(restored.state["optim"])
        step = restored.step
        del restored
        if device.type == "cuda":
            torch.cuda.synchronize()
    ready_s = time.perf_counter() - t0
    log.write(json.dumps({"launch": os.getpid(), "restored": step, "restore_to_gpu_s": ready_s,
                          "context_s": context_s}) + "\n")  # fmt: skip
    snap.resumed_from(step)
    for _ in range(args.child_steps):
        train_step(model, optim, x)
        step += 1
        snap.step(step)
        log.write(json.dumps({"step": step, "t": time.time(), "committed": snap.committed_step}) + "\n")
    snap.close(remove=True)
    return 0


def kill_test(args: argparse.Namespace, device: Any) -> None:
    log = Path(args.out) / "killed.jsonl"
    log.unlink(missing_ok=True)
    step_s = args.step_ms / 1e3 * args.kill_gib / 4 if args.step_ms else 0.02 * args.kill_gib / 4
    batch = calibrate(args.kill_gib, device, step_s)
    base = [sys.executable, __file__, "--child", "--log", str(log), "--kill-gib", str(args.kill_gib),
            "--batch", str(batch), "--every", str(args.every)]  # fmt: skip
    first = subprocess.Popen([*base, "--child-steps", "100000"])
    deadline = time.time() + 240
    while time.time() < deadline:  # kill_after steps after the first snapshot's commit
        steps = [line for line in _lines(log) if "step" in line]
        committed = [line["step"] for line in steps if line["committed"] is not None]
        if committed and steps[-1]["step"] >= committed[0] + args.kill_after:
            break
        time.sleep(0.05)
    time.sleep(0.137)  # anywhere in a step
    first.send_signal(signal.SIGKILL)
    first.wait()
    last = max(line["step"] for line in _lines(log) if "step" in line)
    second = subprocess.run([*base, "--child-steps", "3"], check=False)
    launches = [line for line in _lines(log) if "launch" in line]
    relaunch = launches[-1]
    print(f"kill -9 after step {last} (logged by the loop); relaunch rc {second.returncode}: restored step "
          f"{relaunch['restored']}, steps lost {last - relaunch['restored']} (K = {args.every}); CUDA context "
          f"{relaunch['context_s']:.2f} s, then restore to the GPU {relaunch['restore_to_gpu_s']:.2f} s",
          flush=True)  # fmt: skip


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, nargs="*", default=[4.0, 16.0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=0.0, help="step time per 4 GiB (default 20 ms)")
    parser.add_argument("--kill-gib", type=float, default=0.0)
    parser.add_argument("--kill-after", type=int, default=40)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--child-steps", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--log", default="")
    args = parser.parse_args()
    if args.child:
        return child(args)
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("GPUWATCH_JOB_ID", "snapshot-cost")
    if args.gib:
        sizes(args, device)
    if args.kill_gib:
        kill_test(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
