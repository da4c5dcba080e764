"""A small DDP trainer wired to gpuwatch: the workload of the quarantine-and-resume drill.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m gpuwatch.examples.trainer --steps 400 --ckpt-dir /tmp/ckpt

A 2-layer MLP learns a fixed function from synthetic data that depends only on the step, so
a run that stops, loses a GPU and resumes on fewer ranks sees the same samples. The global
batch stays constant when the world shrinks: each rank takes every world_size-th sample and
accumulates gradients over micro-batches. Each step the ranks all-reduce their
`TrainerLink.stop_requested` flags (MAX), so they all stop at the same step; then rank 0 saves a
checkpoint and every rank exits 75. When a peer dies instead (or hangs while a stop is pending),
each step's collectives run inside `TrainerLink.rescue`: the survivors save the last completed step
with no collective call and exit 75, so the relaunch loses no step; `--no-rescue` resumes from the
periodic checkpoint instead (sharded state's only way) and counts the steps lost. At the end rank 0
prints a JSON summary as its last line.

`progress.json` in the checkpoint directory carries what the summary needs across launches:
one entry per launch with its world size, the step it resumed from and the furthest step it
reached; `steps.jsonl` is the job's own step log (rank 0): a line per launch (the step it resumed
from, and whether out of host memory or the disk) and a line per finished step, with the time.
Without torchrun (no RANK in the environment) it runs as a single process.

`--snapshot-every K|auto` keeps host-memory snapshots (gpuwatch.snapshots): a relaunch on the same
node resumes from the newest one every rank holds before it reads the disk, each rank saying where
its state came from; the periodic checkpoint and the rescue are written from the snapshot.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatch.examples.steplog import StepLog
from gpuwatch.trainer.checkpoint import load_latest, save_checkpoint
from gpuwatch.trainer.link import TrainerLink

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from gpuwatch.snapshots import HostSnapshot

PROGRESS = "progress.json"
CHECKPOINT_PAUSE_S = 600.0  # the most a blocking checkpoint save may take (declared to the daemon as a pause)
STEP_LOG = "steps.jsonl"
_IN, _HIDDEN = 32, 64
_SEED = 1234


def main(argv: list[str] | None = None) -> int:
    """Train, resuming from the checkpoint directory; exit 75 when gpuwatch asks to stop.

    Args:
        argv: command-line arguments (default sys.argv[1:]).

    Raises:
        SystemExit: 75 after a stop request (checkpoint saved), 2 on bad arguments.
        CheckpointError: checkpoints exist but none verifies, or a save failed.
    """
    args = _parse_args(argv)
    if args.in_place:
        return _main_in_place(args)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _default_single_process_env()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:  # a blocked NCCL collective is aborted by TrainerLink (rescue)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:  # gloo cannot be aborted: a peer that hangs ends the collective at this timeout
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.gloo_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch < world:
        raise SystemExit(f"--global-batch {args.global_batch} is smaller than the world size {world}")
    ckpt_dir = Path(args.ckpt_dir)

    torch.manual_seed(_SEED)
    net = torch.nn.Sequential(torch.nn.Linear(_IN, _HIDDEN), torch.nn.ReLU(), torch.nn.Linear(_HIDDEN, 1)).to(device)
    optim = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    link = TrainerLink(
        report_interval_s=args.report_interval,
        term_signal=None if args.ignore_stop else signal.SIGTERM,
        abort_after_s=args.abort_after,
        allow_drills=args.allow_drills,
    )
    snap = _host_snapshot(args.snapshot_every, ckpt_dir, net, optim)
    with link, snap or contextlib.nullcontext():
        resumed_from, source = _resume(ckpt_dir, net, optim, rank, snap, device)
        step = resumed_from or 0
        model = DistributedDataParallel(net, device_ids=[local_rank] if use_cuda else None)
        progress = _load_progress(ckpt_dir)
        if rank == 0 and progress["launches"]:  # a kill between the step log's line and progress.json's write
            logged = _last_logged_step(ckpt_dir / STEP_LOG)
            progress["launches"][-1]["furthest"] = max(progress["launches"][-1]["furthest"], logged or 0)
        progress["launches"].append({"world_size": world, "resumed_from": resumed_from, "furthest": step})
        step_log = StepLog(ckpt_dir / STEP_LOG) if rank == 0 else None
        if step_log is not None:
            step_log.write(launch=len(progress["launches"]) - 1, resumed_from=resumed_from, source=source)
        if rank == 0:
            _save_progress(ckpt_dir, progress)
            micro_batches = -(-len(range(0, args.global_batch, world)) // args.micro_batch)
            print(f"rank 0: world {world}, global batch {args.global_batch}, {micro_batches} micro-batch(es) per rank")

        def checkpoint(wait: bool = False) -> None:
            if snap is not None and not wait:  # rank 0 writes it from host memory, in the background
                snap.checkpoint(ckpt_dir, step)
            else:
                with link.pause("checkpoint", up_to_s=CHECKPOINT_PAUSE_S):  # blocking: no step until it is written
                    if snap is not None:
                        snap.checkpoint(ckpt_dir, step, wait=True)
                    else:
                        save_checkpoint(ckpt_dir, step, {"model": net.state_dict(), "optim": optim.state_dict()})
            if rank == 0:
                _save_progress(ckpt_dir, progress)

        def rescue_save(last: int) -> None:
            """A peer is gone: this survivor saves the last completed step alone (DDP: its state is everyone's)."""
            if snap is not None:  # committed in host memory first, then written from it
                path = snap.rescue(ckpt_dir, last)
            else:
                state = {"model": net.state_dict(), "optim": optim.state_dict()}
                path = save_checkpoint(ckpt_dir, last, state, single_writer=True)
            print(f"rank {rank}: rescued step {last} into {path}", file=sys.stderr, flush=True)

        save = None if args.no_rescue else rescue_save
        saved_step = step
        warned_ignore = False
        while step < args.steps:
            with link.rescue(save):  # the step's collectives; the state changes only after the block
                wants_stop = link.stop_requested and not args.ignore_stop
                if link.stop_requested and args.ignore_stop and not warned_ignore:
                    print(f"rank {rank}: ignoring stop request ({link.stop_reason}): --ignore-stop", file=sys.stderr)
                    warned_ignore = True
                flag = torch.tensor([1.0 if wants_stop else 0.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0:
                    link.request_stop("another rank was asked to stop")  # no-op where the request arrived
                    if rank == 0:
                        print(f"rank 0: stopping at step {step}: {link.stop_reason}", flush=True)
                    if saved_step != step:
                        checkpoint(wait=True)
                    dist.barrier()
                    dist.destroy_process_group()
                    link.exit_for_resume()
                loss, grad_norm = _forward_backward(
                    model, step, args.global_batch, args.micro_batch, rank, world, device
                )
            optim.step()
            step += 1
            link.step(step, loss, grad_norm)
            if snap is not None:  # before the step is logged: its return bounds the snapshot's lag (K)
                snap.step(step)
            if step_log is not None:  # first: the next launch takes a step logged but not yet in progress.json
                step_log.write(step=step)
            progress["launches"][-1]["furthest"] = step
            if rank == 0:
                _save_progress(ckpt_dir, progress)  # every step, so a killed launch still counts its lost steps
            if step % args.ckpt_every == 0 or step == args.steps:
                with link.rescue(save):
                    checkpoint()
                saved_step = step
            if args.step_sleep > 0:
                time.sleep(args.step_sleep)
        with link.rescue(save):
            dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(_summary(progress, step)), flush=True)
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.examples.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="train until this step")
    parser.add_argument("--ckpt-dir", required=True, help="checkpoint directory (also holds progress.json)")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward on one rank")
    parser.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every K steps")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--report-interval", type=float, default=2.0, help="TrainerLink report interval (s)")
    parser.add_argument("--ignore-stop", action="store_true", help="never stop on request (grace-period tests)")
    parser.add_argument(
        "--no-rescue", action="store_true", help="when a peer dies, resume from the periodic checkpoint (as sharded)"
    )
    parser.add_argument("--abort-after", type=float, default=5.0, help="TrainerLink abort_after_s (s)")
    parser.add_argument("--gloo-timeout", type=float, default=30.0, help="gloo collective timeout (s), CPU only")
    parser.add_argument("--allow-drills", action="store_true", help="accept gpuwatch drill --fault-rank (XID 31)")
    parser.add_argument(
        "--snapshot-every", metavar="K|auto", help="host-memory snapshot every K steps (auto: by measured cost)"
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="recover in place (gpuwatch.inplace; run under gpuwatch launch --in-place)",
    )
    parser.add_argument("--step-log", help="--in-place: directory of the per-rank step logs (default: --ckpt-dir)")
    args = parser.parse_args(argv)
    if args.snapshot_every is not None:
        from gpuwatch.snapshots.cadence import parse_every

        try:
            parse_every(args.snapshot_every)
        except ValueError as exc:
            parser.error(f"--snapshot-every: {exc}")
    for name in ("steps", "global_batch", "micro_batch", "ckpt_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("abort_after", "gloo_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def _default_single_process_env() -> None:
    """Outside torchrun, be a world of one (init_process_group reads these)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    defaults.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def _host_snapshot(
    every: str | None, ckpt_dir: Path, net: torch.nn.Module, optim: torch.optim.Optimizer
) -> HostSnapshot | None:
    """The rank's host snapshot with --snapshot-every; its job id outside torchrun and launch: the checkpoint dir's."""
    if every is None:
        return None
    import hashlib

    from gpuwatch.snapshots import HostSnapshot

    job_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("GPUWATCH_JOB_ID")
    job_id = job_id or "example-" + hashlib.sha256(str(ckpt_dir.resolve()).encode()).hexdigest()[:16]

    def state() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": optim.state_dict()}

    return HostSnapshot(state, every=every, optimizer=optim, replicated=True, job_id=job_id)


def _resume(
    ckpt_dir: Path,
    net: torch.nn.Module,
    optim: torch.optim.Optimizer,
    rank: int,
    snap: HostSnapshot | None,
    device: torch.device,
) -> tuple[int | None, str | None]:
    """Load the newest state into `net` and `optim`: its step and source ("memory", "disk"), or (None, None).

    On a GPU a host snapshot goes straight onto it from the pinned slot (restore's device path).
    """
    if snap is not None:
        restored = snap.resume(ckpt_dir, device=device if device.type == "cuda" else None)
        if restored is None:
            return None, None
        print(f"rank {rank}: resuming from step {restored.step} ({restored.source}: {restored.where})", flush=True)
        net.load_state_dict(restored.state["model"])
        optim.load_state_dict(restored.state["optim"])
        return restored.step, restored.source
    loaded = load_latest(ckpt_dir)
    if rank == 0:
        for name, reason in loaded.skipped if loaded else ():
            print(f"rank 0: skipped checkpoint {name}: {reason}")
        if loaded is not None:
            print(f"rank 0: resuming from step {loaded.step} ({loaded.path})")
        elif os.environ.get("GPUWATCH_RESUME") == "1":
            print(f"rank 0: GPUWATCH_RESUME=1 but no checkpoint in {ckpt_dir}: starting at step 0")
    if loaded is None:
        return None, None
    net.load_state_dict(loaded.state["model"])
    optim.load_state_dict(loaded.state["optim"])
    return loaded.step, "disk"


def _last_logged_step(path: Path) -> int | None:
    """The last step the step log holds for its last launch (None: none), read from the file's tail."""
    try:
        with path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))
            tail = log.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:  # the first line of the tail, cut by the seek
            continue
        if "launch" in entry:
            return None
        if "step" in entry:
            return int(entry["step"])
    return None


def _batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: the same samples whatever the world size."""
    import torch

    target = torch.randn(_IN, 1, generator=torch.Generator().manual_seed(_SEED))
    x = torch.randn(global_batch, _IN, generator=torch.Generator().manual_seed(_SEED + 1 + step))
    return x, torch.tanh(x @ target)


def _forward_backward(
    model: DistributedDataParallel,
    step: int,
    global_batch: int,
    micro_batch: int,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[float, float]:
    """Gradients of this rank's share of the global batch of `step` (all-reduced); its loss share and the grad norm.

    Each micro-batch's summed loss is scaled by world/global_batch: DDP averages gradients over
    the ranks, so the update is the mean over the global batch whatever world and micro-batch are.
    The parameters are not touched (the caller's optimizer.step() does that after the rescue block).
    """
    import torch

    x, y = _batch(step, global_batch)
    xs, ys = x[rank::world].to(device).split(micro_batch), y[rank::world].to(device).split(micro_batch)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i, (xb, yb) in enumerate(zip(xs, ys, strict=True)):
        with contextlib.nullcontext() if i == len(xs) - 1 else model.no_sync():
            loss = torch.nn.functional.mse_loss(model(xb), yb, reduction="sum") * world / global_batch
            loss.backward()
        total += loss.item() / world
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    return total, float(grad_norm)


def _load_progress(ckpt_dir: Path) -> dict[str, Any]:
    try:
        progress = json.loads((ckpt_dir / PROGRESS).read_text())
    except FileNotFoundError:
        return {"launches": []}
    if not isinstance(progress, dict) or not isinstance(progress.get("launches"), list):
        raise SystemExit(f"{ckpt_dir / PROGRESS} is not a progress file")
    return progress


def _save_progress(ckpt_dir: Path, progress: dict[str, Any]) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f"{PROGRESS}.tmp"
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, ckpt_dir / PROGRESS)


def _summary(progress: dict[str, Any], step: int) -> dict[str, Any]:
    """The run across launches; a stop loses the steps between its furthest step and the next resume."""
    launches = progress["launches"]
    lost = sum(
        max(0, before["furthest"] - (after["resumed_from"] or 0))
        for before, after in zip(launches[:-1], launches[1:], strict=True)
    )
    return {
        "steps_done": step,
        "restarts": len(launches) - 1,
        "resumed_from_steps": [launch["resumed_from"] for launch in launches[1:] if launch["resumed_from"] is not None],
        "world_sizes": [launch["world_size"] for launch in launches],
        "lost_steps": lost,
    }


def _main_in_place(args: argparse.Namespace) -> int:
    """The same training under gpuwatch.inplace: survivors go on in the same process, joiners get the state from a peer.

    Each rank appends one JSON line per step to `steps.<pid>.jsonl` (pid, member, generation, rank,
    world, step, a parameter checksum, and on the first step of a generation how the rank got there),
    so a test or a bench reads the job's own account. Rank 0 alone writes the periodic checkpoint
    (no collective), which only a generation with no state holder reads (the `load` callback).
    """
    import logging

    import torch

    from gpuwatch.inplace import InPlaceJob, NotInPlace, checksum

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ckpt_dir = Path(args.ckpt_dir)
    log_dir = Path(args.step_log or ckpt_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(_SEED)
    net = torch.nn.Sequential(torch.nn.Linear(_IN, _HIDDEN), torch.nn.ReLU(), torch.nn.Linear(_HIDDEN, 1)).to(device)
    optim = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def load() -> int | None:
        loaded = load_latest(ckpt_dir)
        if loaded is None:
            return None
        net.load_state_dict(loaded.state["model"])
        optim.load_state_dict(loaded.state["optim"])
        print(f"loaded checkpoint step {loaded.step} ({loaded.path})", file=sys.stderr, flush=True)
        return loaded.step

    def save(step: int) -> None:
        with link.pause("checkpoint", up_to_s=CHECKPOINT_PAUSE_S):
            save_checkpoint(
                ckpt_dir, step, {"model": net.state_dict(), "optim": optim.state_dict()}, single_writer=True
            )

    link = TrainerLink(
        report_interval_s=args.report_interval, abort_after_s=args.abort_after, allow_drills=args.allow_drills
    )
    with link, StepLog.per_process(log_dir) as step_log:
        try:
            job = InPlaceJob(net, optim, link, load=load, save=save, collective_timeout_s=args.gloo_timeout)
        except NotInPlace as exc:
            print(f"python -m gpuwatch.examples.trainer: error: --in-place: {exc}", file=sys.stderr)
            return 2
        generation = None
        while job.step < args.steps:
            loss, grad_norm = job.train_step(
                lambda ddp: _forward_backward(
                    ddp, job.step, args.global_batch, args.micro_batch, job.rank, job.world_size, device
                )
            )
            link.step(job.step, loss, grad_norm)
            line: dict[str, Any] = {
                "t": time.time(),
                "pid": os.getpid(),
                "member": job.member,
                "generation": job.generation,
                "rank": job.rank,
                "world": job.world_size,
                "step": job.step,
                "checksum": checksum(net),
            }
            if job.generation != generation and job.last_change is not None:
                change = job.last_change
                line["change"] = {"reason": change.reason, "source": change.source, "seconds": change.seconds}
                generation = job.generation
            step_log.write(**line)
            if job.rank == 0 and (job.step % args.ckpt_every == 0 or job.step == args.steps):
                save(job.step)
            if args.step_sleep > 0:
                time.sleep(args.step_sleep)
        rank, summary = job.rank, {"steps_done": job.step, "generations": job.generation, "world_size": job.world_size}
        job.close()
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
