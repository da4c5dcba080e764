"""A user's training loop written from docs/spares.md, with a set-up that takes seconds (tests and the GPU script).

    gpuwatch launch --in-place --spares 1 -- tests/spares/user_loop.py --log-dir DIR [--steps S] [--every K] ...

Built the way most scripts build a job: a stack of Linear layers made with torch's default init on the
CPU, then moved to the device; AdamW; a data index built before the job object (a seeded corpus
hashed and sorted: the work a tokenizer or a dataset index does); then `TrainerLink()` and
`ShardedJob(...)`, a host snapshot every K steps. The batch of a step is a function of the seed, the
step and the rank only, so a run's loss at every step can be compared with an uninterrupted run's.

Each process writes `setup.<pid>.json` when its set-up is done (before the join: a standby writes it
too) and appends one JSON line per step to `steps.<pid>.jsonl`: t, pid, rank, world, generation, step,
loss (and on its first line the set-up's seconds and how it got its state; on the first line after its
host snapshots are set up their mode and GPU budget), so a test reads its figures from the loop itself.
`--read-rank-early` reads $RANK before the set-up (a script the standby cannot run ahead: it waits there).
`--gate FILE` holds the loop at step 10 until FILE exists, so a test faults it only once its standby is ready.
`--slow-step N --slow-s S`: the step after step N takes S seconds more (an evaluation, a checkpoint: a fault
in it comes long after the last step's end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.time()


def main(argv: list[str] | None = None) -> int:
    """Set up, join the job, train --steps steps; 0 at the end."""
    parser = argparse.ArgumentParser(prog="user_loop.py")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=4, help="a host snapshot every K steps")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--gib", type=float, default=0.0, help="size the state (fp32 parameters and AdamW's two moments) to this much"
    )
    parser.add_argument("--index-items", type=int, default=4_000_000, help="the data index's size (its set-up cost)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--read-rank-early", action="store_true")
    parser.add_argument("--checksum", action="store_true", help="log the parameters' sum (float64) at every step")
    parser.add_argument("--allow-drills", action="store_true")
    parser.add_argument("--gate", help="from step 10 on, step only while this file exists (a test's pause)")
    parser.add_argument("--slow-step", type=int, default=0, help="the step after which the loop sleeps --slow-s")
    parser.add_argument("--slow-s", type=float, default=0.0, help="... instead of --step-sleep (a slow step in flight)")
    args = parser.parse_args(argv)
    if args.read_rank_early:
        print(f"user loop: rank {os.environ.get('RANK')}", flush=True)
    import torch

    from gpuwatch.inplace.sharded import ShardedJob
    from gpuwatch.trainer import TrainerLink

    torch.manual_seed(args.seed)
    layers = args.layers if args.gib <= 0 else max(1, round(args.gib * 2**30 / 12 / (args.width * (args.width + 1))))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])  # default init
    device = torch.device(args.device)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    index = _data_index(torch, args.index_items, args.seed)
    setup_s = time.time() - STARTED
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"setup.{os.getpid()}.json").write_text(json.dumps({"setup_s": setup_s, "t": time.time()}))
    link = TrainerLink(report_interval_s=0.2, allow_drills=args.allow_drills)
    with link, (log_dir / f"steps.{os.getpid()}.jsonl").open("a") as log:
        job = ShardedJob(model, optimizer, link, every=args.every, backend="nccl" if device.type == "cuda" else "gloo")
        first, slowed, said_snapshot = True, False, False
        while job.step < args.steps:
            while args.gate and job.step >= 10 and not os.path.exists(args.gate):
                time.sleep(0.01)

            def forward_backward(ddp: Any) -> float:
                g = torch.Generator().manual_seed(args.seed * 1_000_003 + job.step * 1009 + job.rank)
                rows = index[torch.randint(0, len(index), (args.batch,), generator=g)]
                x = (rows.unsqueeze(1) % 997).float().div(997).expand(args.batch, args.width).contiguous()
                x = x + torch.randn(args.batch, args.width, generator=g)
                y = torch.randn(args.batch, args.width, generator=g)
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
                loss.backward()
                return float(loss.item())

            loss = job.train_step(forward_backward)
            link.step(job.step, loss)
            line: dict[str, Any] = {"t": time.time(), "pid": os.getpid(), "rank": job.rank, "world": job.world_size}
            line.update(generation=job.generation, step=job.step, loss=loss)
            snapshot = getattr(job.source, "snapshot", None)  # snapshots start once its slots are set up
            line["snapshots_from"] = snapshot.ready_step if snapshot is not None else None
            line["committed"] = snapshot.committed_step if snapshot is not None else None  # its own, newest
            if snapshot is not None and snapshot.ready_step is not None and not said_snapshot:
                stats = snapshot.stats()
                line["snapshot"] = {k: stats[k] for k in ("mode", "gpu_bytes", "gpu_budget", "gpu_budget_why")}
                said_snapshot = True
            if args.checksum:
                line["checksum"] = sum(float(p.double().sum()) for p in model.parameters())
            if first:
                change = job.last_change
                line.update(setup_s=setup_s, started=STARTED, source=change.source if change else None)
                line["join_parts"] = change.parts if change else None  # where the join's seconds went
                line["spare_warm_s"] = os.environ.get("GPUWATCH_SPARE_WARM_S")
                first = False
            log.write(json.dumps(line) + "\n")
            log.flush()
            slow = job.step == args.slow_step and not slowed  # once: a step redone after a fault is not slow
            slowed = slowed or slow
            pause = args.slow_s if slow else args.step_sleep
            if pause > 0:
                time.sleep(pause)
        job.close()
    return 0


def _data_index(torch: Any, items: int, seed: int) -> Any:
    """A seeded corpus's documents, hashed and sorted by hash: the order the loop samples from."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.randint(0, 2**31 - 1, (items,), generator=g, dtype=torch.int64)
    hashed = docs
    for _ in range(4):
        hashed = (hashed * 6364136223846793005 + 1442695040888963407) % (2**61 - 1)
    return docs[torch.argsort(hashed)][: max(1, items // 16)]


if __name__ == "__main__":
    sys.exit(main())
