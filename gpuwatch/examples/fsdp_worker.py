"""An FSDP2 job for tests and the GPU script: a rank of an FSDPJob (`fully_shard`, optionally tensor parallel).

    python -m gpuwatch.examples.fsdp_worker --log-dir DIR [--steps S] [--every K] [--tp T] [--width W] [--layers L]

An MLP of L hidden layers of width W (`fully_shard` on each layer and on the root; with `--tp T` a 2-D
mesh (dp, tp): each layer pair column- then row-wise tensor parallel, FSDP over dp) trained with AdamW
on batches drawn from the step and the rank's dp index, so a run is a pure function of its seed:
every step's loss equals an uninterrupted run's. The model is built on the CPU with torch's default
init (seed 0) and moved to the rank's device, as users do; after a membership change, when the state
comes from the old model or a host snapshot, it is built on the meta device instead (its values are
overwritten). Each step appends one JSON line to `<log-dir>/steps.<pid>.jsonl` (steplog.py: t, pid, member,
generation, rank, world, step, loss, a checksum of this rank's shards unless --no-checksum; on a generation's first step
where its state came from and the seconds of the change). `--steps 0` runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from typing import Any

from gpuwatch.examples.steplog import StepLog


def main(argv: list[str] | None = None) -> int:
    """Train under `gpuwatch launch --in-place`; 0 after --steps steps."""
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.examples.fsdp_worker")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--steps", type=int, default=0, help="0: until SIGTERM")
    parser.add_argument("--every", type=int, default=3, help="host snapshot every K steps")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (a 2-D mesh when > 1)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl when CUDA is there")
    parser.add_argument("--collective-timeout", type=float, default=30.0)
    parser.add_argument("--shrink", action="store_true", help="go on with fewer ranks when one leaves for good")
    parser.add_argument("--no-checksum", action="store_true", help="log no shard checksum (a large model's cost)")
    args = parser.parse_args(argv)
    import torch

    from gpuwatch.inplace.fsdp import FSDPJob
    from gpuwatch.trainer import TrainerLink

    logging.basicConfig(level=os.environ.get("GPUWATCH_FSDP_LOG", "WARNING"), format="%(name)s: %(message)s")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def build(mesh: Any, init: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        return _build(mesh, init, args.width, args.layers, args.tp, device)

    link = TrainerLink(report_interval_s=1.0)
    with link, StepLog.per_process(args.log_dir) as log:
        # A 2-D mesh's shape needs the world size before the join (a standby then waits at this read);
        # a 1-D mesh is the job's whole group, known at the join.
        mesh_shape = (int(os.environ.get("WORLD_SIZE", "1")) // args.tp, args.tp) if args.tp > 1 else None
        names = ("dp", "tp") if args.tp > 1 else None
        job = FSDPJob(
            build, link, every=args.every, mesh_shape=mesh_shape, mesh_dim_names=names,
            backend=backend, collective_timeout_s=args.collective_timeout, shrink=args.shrink,
        )  # fmt: skip
        generation = None
        while args.steps == 0 or job.step < args.steps:

            def forward_backward(model: torch.nn.Module) -> float:
                job.optimizer.zero_grad(set_to_none=True)
                return _loss_and_grads(model, job.step, job.rank // args.tp, args.width, device)

            loss = job.train_step(forward_backward)
            link.step(job.step, loss)
            line = _line(job, loss, changed=job.generation != generation)
            line["checksum"] = None if args.no_checksum else shard_checksum(job.model)
            log.write(**line)
            generation = job.generation
            time.sleep(args.step_sleep)
        job.close()
    return 0


def _loss_and_grads(model: Any, step: int, dp_rank: int, width: int, device: Any) -> float:
    """The loss of the step's batch for this dp rank (its tp ranks share it: a function of both alone), backward."""
    import torch

    g = torch.Generator().manual_seed(step * 1000 + dp_rank)
    x, y = torch.randn(8, width, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return float(loss.item())


def _line(job: Any, loss: float, *, changed: bool) -> dict[str, Any]:
    """The step's log line; on a generation's first step, where its state came from and how long it took."""
    line = dict(t=time.time(), pid=os.getpid(), member=job.member, generation=job.generation, rank=job.rank)
    line.update(world=job.world_size, step=job.step, loss=loss)
    change = job.last_change
    if changed and change is not None:
        line["change"] = {
            "reason": change.reason,
            "source": change.source,
            "seconds": change.seconds,
            "parts": change.parts,
        }
    return line


def _build(mesh: Any, init: bool, width: int, layers: int, tp: int, device: Any) -> tuple[Any, Any]:
    """The MLP on the mesh: built on the CPU with the default init and moved (init), else on meta and emptied."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def make() -> torch.nn.Sequential:
        torch.manual_seed(0)
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width))
            for _ in range(layers)
        ]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))

    if init:
        model = make().to(device)
    else:
        with torch.device("meta"):
            model = make()
    dp_mesh = mesh["dp"] if tp > 1 else mesh
    for block in list(model)[:layers]:
        if tp > 1:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if not init:
        model.to_empty(device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def shard_checksum(model: Any) -> str:
    """A digest of this rank's own shards of the parameters (equal across runs at the same step and rank)."""
    import torch

    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value
        digest.update(name.encode())
        digest.update(local.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    sys.exit(main())
