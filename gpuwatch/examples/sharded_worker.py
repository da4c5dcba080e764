"""A sharded job for tests, the bench and drills: a rank of a ShardedJob with ZeroRedundancyOptimizer.

    python -m gpuwatch.examples.sharded_worker --log-dir DIR [--state-bytes N] [--every K] [--steps S]

Each rank trains a small MLP with Adam, whose moments ZeroRedundancyOptimizer shards over the ranks,
beside a frozen block of `--state-bytes` (a model's frozen weights: state every snapshot holds, so a
restore's cost grows with it while a step stays short). Every K steps each rank snapshots its own
state in host memory. Each step appends one JSON line to `<log-dir>/steps.<pid>.jsonl` (steplog.py: t, pid,
member, generation, rank, world, step, a checksum of the parameters, the newest step this process
committed to its host snapshot; on the first line when the
process started, when its imports, its model and its ShardedJob were done, and how many seconds it
waited as a warm spare; on a generation's first step how the rank got its state and where the
seconds of that change went), so a test reads its figures from the job itself. Runs `--steps` steps
(0: until SIGTERM, which the TrainerLink turns into the end of the process). `--allow-drills` lets
`gpuwatch drill --fault-rank` (SIGUSR2) raise a real XID 31.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from gpuwatch.examples.steplog import StepLog

STARTED = time.time()


def main(argv: list[str] | None = None) -> int:
    """Train under `gpuwatch launch --in-place`; 0 after --steps steps."""
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.examples.sharded_worker")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--state-bytes", type=int, default=0)
    parser.add_argument("--every", type=int, default=3, help="snapshot every K steps")
    parser.add_argument("--steps", type=int, default=0, help="0: until SIGTERM")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl when CUDA is there")
    parser.add_argument("--collective-timeout", type=float, default=30.0)
    parser.add_argument("--allow-drills", action="store_true")
    args = parser.parse_args(argv)
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from gpuwatch.inplace import checksum
    from gpuwatch.inplace.sharded import ShardedJob
    from gpuwatch.trainer import TrainerLink
    from gpuwatch.trainer.contract import SPARE_WARM_S_ENV

    marks = {"imported": time.time()}  # where a replacement's start goes, on its first line
    logging.basicConfig(level=os.environ.get("GPUWATCH_SHARDED_LOG", "WARNING"), format="%(name)s: %(message)s")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    model = torch.nn.Sequential(mlp)
    frozen = torch.zeros(max(0, args.state_bytes) // 4, device=device)
    model.register_parameter("frozen", torch.nn.Parameter(frozen, requires_grad=False))
    marks["built"] = time.time()
    link = TrainerLink(report_interval_s=1.0, allow_drills=args.allow_drills)
    with link, StepLog.per_process(args.log_dir) as log:
        job = ShardedJob(
            model,
            lambda: ZeroRedundancyOptimizer(mlp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01),
            link,
            every=args.every,
            backend=backend,
            collective_timeout_s=args.collective_timeout,
        )
        marks["joined"] = time.time()
        generation = None
        while args.steps == 0 or job.step < args.steps:

            def forward_backward(ddp: Any) -> float:
                g = torch.Generator().manual_seed(job.step * 1000 + job.rank)
                x, y = torch.randn(8, 32, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)
                job.optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                return float(loss.item())

            loss = job.train_step(forward_backward)
            link.step(job.step, loss)
            line: dict[str, Any] = {"t": time.time(), "pid": os.getpid(), "member": job.member}
            line.update(generation=job.generation, rank=job.rank, world=job.world_size, step=job.step)
            line["checksum"] = checksum(mlp)
            line["committed"] = job.snapshot.committed_step if job.snapshot is not None else None
            if generation is None:
                line["started"], line["marks"] = STARTED, marks
                line["spare_warm_s"] = float(os.environ[SPARE_WARM_S_ENV]) if SPARE_WARM_S_ENV in os.environ else None
            if job.generation != generation and job.last_change is not None:
                change = job.last_change
                line["change"] = {"reason": change.reason, "source": change.source, "seconds": change.seconds}
                line["change"]["parts"] = change.parts
                generation = job.generation
            log.write(**line)
            if args.step_sleep > 0:
                time.sleep(args.step_sleep)
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
