"""The workload of the in-place recovery bench: a rank holding `--state-bytes` of training state.

Most of the state is a frozen block (a model's frozen weights: part of the state every joiner must
receive, never all-reduced), beside a small trainable MLP with SGD momentum, so a step stays short
whatever the state's size while a join moves all of it. Each step appends one JSON line to
`<log-dir>/steps.<pid>.jsonl` (steplog.py, as the example trainer does); the first line also says when the
process started. Runs until SIGTERM.

    python -m gpuwatch.examples.bench_worker --state-bytes 1073741824 --log-dir DIR --backend gloo
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

from gpuwatch.examples.steplog import StepLog

STARTED = time.time()


def main(argv: list[str] | None = None) -> int:
    """Train until SIGTERM under `gpuwatch launch --in-place` (or the bench's supervisor)."""
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.examples.bench_worker")
    parser.add_argument("--state-bytes", type=int, required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    args = parser.parse_args(argv)
    # Big CPU tensors in transparent huge pages: with 4 KiB pages the kernel alone takes 0.19 s to free a
    # killed rank's 2 GiB before its sockets close (0.07 s with huge pages), a cost of the CPU stand-in.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import torch

    from gpuwatch.inplace import InPlaceJob, checksum

    logging.basicConfig(
        level=os.environ.get("GPUWATCH_INPLACE_BENCH_LOG", "ERROR"), format="%(relativeCreated)d %(message)s"
    )

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    model = torch.nn.Sequential(mlp)  # plus the frozen block: state every joiner receives, never all-reduced
    frozen = max(0, args.state_bytes - 2 * _nbytes(mlp)) // 4  # the MLP's weights and momentum count too
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(frozen, device=device), requires_grad=False))
    optim = torch.optim.SGD(mlp.parameters(), lr=0.01, momentum=0.9)
    job = InPlaceJob(model, optim, backend=args.backend, collective_timeout_s=30.0)
    generation = None
    with StepLog.per_process(args.log_dir) as log:
        while not stop:

            def forward_backward(ddp: Any) -> float:
                g = torch.Generator().manual_seed(job.step * 1000 + job.rank)
                x, y = torch.randn(8, 32, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)
                optim.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                return float(loss.item())

            job.train_step(forward_backward)
            line: dict[str, Any] = {"t": time.time(), "pid": os.getpid(), "generation": job.generation}
            line.update(rank=job.rank, world=job.world_size, step=job.step, checksum=checksum(mlp))
            if generation is None:
                line["started"] = STARTED
            if job.generation != generation and job.last_change is not None:
                change = job.last_change
                line["change"] = {"source": change.source, "seconds": change.seconds, "moved": change.moved_bytes}
                generation = job.generation
            log.write(**line)
            time.sleep(args.step_sleep)
    job.close()
    return 0


def _nbytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


if __name__ == "__main__":
    sys.exit(main())
