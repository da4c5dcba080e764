"""What host snapshots cost a real training loop, from the loop's own step log (run on a GPU machine).

    python tests/hardware/snapshot_cost.py --gib 4 16 --steps 200 [--repeat 2] [--batches 2394 2002] [--kill]

Per state size: fp32 weights + AdamW (a stack of square linear layers; state = weights and both
moments), the batch sized so a step takes --step-ms (20 ms per 4 GiB of state by default; --batches
gives it per size instead). Each loop logs its own step wall times (loss.item() every step). Runs,
--repeat times over: no snapshots, snapshots every --every steps, every="auto" (the second size:
none, auto, every K), all with one HostSnapshot whose slots are set up once; the warm-up runs until
the slots are set up and a first snapshot committed, then --steps steps are timed. Printed: the wall
time of each run, the overhead of each run with snapshots against the mean of the runs without, the
largest step after the warm-up, the largest step while the slots were set up, the mode, the drain,
K and what stats() says; then a snapshot of the current step is restored onto the GPU and compared
with the state, byte for byte.

--kill: all of that runs in a child, which after the last size trains on with snapshots every
--every steps, logging each step, and is SIGKILLed --kill-after steps later; a second child
restores onto the GPU: seconds from its CUDA context to the state on the GPU, and steps lost (the
last step the first child logged minus the restored step).
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


def _set_every(snap: Any, every: int | str) -> None:
    """Switch one HostSnapshot between a fixed K and "auto" (its slots are set up once: 20 s at 16 GiB here)."""
    snap._every = None if every == "auto" else int(every)
    snap._auto = every == "auto"
    snap._costs.clear()
    snap._last_snap_step = None


def sizes(args: argparse.Namespace, device: Any) -> None:
    import torch

    from gpuwatch.snapshots import HostSnapshot

    for n, gib in enumerate(args.gib):
        step_s = args.step_ms / 1e3 * gib / 4 if args.step_ms else 0.02 * gib / 4
        batch = args.batches[n] if n < len(args.batches) else calibrate(gib, device, step_s)
        model, optim, x = build(gib, device, batch)
        for _ in range(3):
            train_step(model, optim, x)
        state_gib = sum(t.numel() * t.element_size() for t in _tensors(state_of(model, optim))) / 2**30
        print(f"== {state_gib:.2f} GiB of state, batch {batch}, target step {step_s * 1e3:.0f} ms", flush=True)
        results: dict[str, Any] = {}
        step = 3
        fixed = f"every {args.every}"
        modes = [("none", None), (fixed, args.every), ("auto", "auto")]
        if n % 2:  # alternate the order between sizes
            modes = [("none", None), ("auto", "auto"), (fixed, args.every)]
        runs = [(f"{name} #{k + 1}", every) for k in range(args.repeat) for name, every in modes]
        snap = HostSnapshot(functools.partial(state_of, model, optim), every=args.every, optimizer=optim,
                            replicated=True, job_id=args.job_id or f"cost-{gib}")  # fmt: skip
        for name, every in runs:
            if every is not None:
                _set_every(snap, every)
            out = run(model, optim, x, args.steps, snap if every is not None else None, step)
            step = out["last_step"]
            if every is not None:
                snap.wait()
                out["stats"] = {k: v for k, v in snap.stats().items() if k not in ("directory", "disabled_reason")}
            results[name] = out
            print(f"{name:>12}: {args.steps} steps {out['wall_s']:.3f} s, median step {out['median_s'] * 1e3:.2f} ms, "
                  f"max step {out['max_s'] * 1e3:.1f} ms (warm-up: {out['warm_steps']} steps, max "
                  f"{out['warm_max_s'] * 1e3:.1f} ms)", flush=True)  # fmt: skip
            if every is not None:
                print(f"{'':>12}  stats: {json.dumps(out['stats'])}", flush=True)
        nones = [out["wall_s"] for name, out in results.items() if name.startswith("none")]
        base = statistics.fmean(nones)
        print(f"{state_gib:.2f} GiB: slots set up in {snap.stats()['setup_s']:.1f} s off the training thread; the "
              f"largest step meanwhile {results[runs[1][0]]['warm_max_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
        for mode in (fixed, "auto"):
            walls = [(out["wall_s"], out["stats"]["every"]) for name, out in results.items() if name.startswith(mode)]
            each = ", ".join(f"{wall:.3f} s {wall / base - 1:+.2%} (K = {k})" for wall, k in walls)
            mean = statistics.fmean(wall for wall, _ in walls) / base - 1
            print(f"{state_gib:.2f} GiB {mode}: {each} vs {base:.3f} s without (mean of "
                  f"{', '.join(f'{w:.3f}' for w in nones)}): mean {mean:+.2%}", flush=True)  # fmt: skip
        if snap.snapshot_now(step):  # the drained bytes are the state's: restore them onto the GPU and compare
            t0 = time.perf_counter()
            restored = snap.restore(device=device)
            exact = restored is not None and all(
                torch.equal(a, b.to(a.device)) for a, b in zip(_tensors(state_of(model, optim)),
                                                               _tensors(restored.state), strict=True))  # fmt: skip
            print(f"{state_gib:.2f} GiB: restore(device) of the committed step {step} in process "
                  f"{time.perf_counter() - t0:.2f} s, exact: {exact}", flush=True)  # fmt: skip
            del restored
        if args.log and gib == args.gib[-1]:  # the killed job: train on with snapshots every K, log each step
            _set_every(snap, args.every)
            log = Path(args.log).open("a", buffering=1)
            while True:
                train_step(model, optim, x)
                step += 1
                snap.step(step)
                log.write(json.dumps({"step": step, "t": time.time(), "committed": snap.committed_step}) + "\n")
        snap.close(remove=True)
        del model, optim, x, snap
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
                        job_id=args.job_id or "killed-job")  # fmt: skip
    t0 = time.perf_counter()
    try:
        restored = snap.restore(device=device)
    except Exception as exc:  # the device path failed here: say so, and time the CPU path instead
        print(f"restore(device=cuda) failed: {type(exc).__name__}: {exc}", flush=True)
        t0 = time.perf_counter()
        restored = snap.restore()
    restore_s = time.perf_counter() - t0
    source = restored.source if restored is not None else None
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
                          "restore_s": restore_s, "load_s": ready_s - restore_s, "context_s": context_s,
                          "source": source}) + "\n")  # fmt: skip
    snap.resumed_from(step)
    for _ in range(args.child_steps):
        train_step(model, optim, x)
        step += 1
        snap.step(step)
        log.write(json.dumps({"step": step, "t": time.time(), "committed": snap.committed_step}) + "\n")
    snap.close(remove=True)
    return 0


def kill_test(args: argparse.Namespace, device: Any) -> None:
    """The last --gib size's runs in a child that trains on after them and is SIGKILLed; a second child restores."""
    log = Path(args.out) / "killed.jsonl"
    log.unlink(missing_ok=True)
    job = f"killed-{os.getpid()}"
    base = [sys.executable, __file__, "--job-id", job, "--every", str(args.every), "--steps", str(args.steps),
            "--repeat", str(args.repeat), "--batches", *[str(b) for b in args.batches]]  # fmt: skip
    first = subprocess.Popen([*base, "--gib", *[str(g) for g in args.gib], "--log", str(log)])
    while first.poll() is None:  # kill --kill-after steps into the training after the cost runs
        steps = [line["step"] for line in _lines(log) if "step" in line]
        if steps and steps[-1] >= steps[0] + args.kill_after:
            break
        time.sleep(0.05)
    time.sleep(0.137)  # anywhere in a step
    first.send_signal(signal.SIGKILL)
    first.wait()
    last = max(line["step"] for line in _lines(log) if "step" in line)
    gib = args.gib[-1]
    second = subprocess.run([*base, "--child", "--log", str(log), "--kill-gib", str(gib), "--batch", "256",
                             "--child-steps", "0"],
                            check=False)  # fmt: skip
    relaunch = [line for line in _lines(log) if "launch" in line][-1]
    print(f"kill -9 after step {last} (logged by the loop); relaunch rc {second.returncode}: restored step "
          f"{relaunch['restored']}, steps lost {last - relaunch['restored']} (K = {args.every}); CUDA context "
          f"{relaunch['context_s']:.2f} s, then restore to the GPU {relaunch['restore_to_gpu_s']:.2f} s "
          f"(restore() {relaunch.get('restore_s', 0):.2f} s, load_state_dict {relaunch.get('load_s', 0):.2f} s)",
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
    parser.add_argument("--repeat", type=int, default=2, help="runs of each mode per size")
    parser.add_argument("--batches", type=int, nargs="*", default=[], help="batch per --gib size (no calibration)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="step time per 4 GiB (default 20 ms)")
    parser.add_argument("--kill-gib", type=float, default=0.0)
    parser.add_argument("--kill", action="store_true", help="run the sizes in a child and kill it after the last")
    parser.add_argument("--kill-after", type=int, default=40)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--child-steps", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--log", default="")
    parser.add_argument("--job-id", default="")
    args = parser.parse_args()
    if args.child:
        return child(args)
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("GPUWATCH_JOB_ID", "snapshot-cost")
    if args.kill:
        kill_test(args, device)
    elif args.gib:
        sizes(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
