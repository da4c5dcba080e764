#!/usr/bin/env python3
"""A DDP trainer written only from README.md's snippet ("1. The training loop: TrainerLink").

Not the shipped example: the H200 check runs the rank drills against it too, so what the README
tells a user to write is what is proven to survive a dead or faulted rank. Run under torchrun (or
`gpuwatch launch`); it prints one JSON line at the end: the steps done and the step it started from.

    gpuwatch launch -- tests/hardware/readme_trainer.py --steps 2000 --ckpt-dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpuwatch.trainer import TrainerLink, load_latest, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(256, 256).to(device), device_ids=[local_rank] if cuda else None)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt_dir, total = Path(args.ckpt_dir), args.steps

    def forward_backward(step: int) -> tuple[float, float]:
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step)).to(device)
        optim.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss.item(), float(grad_norm)

    # From here on, the README's snippet as written.
    def state() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def rescue_save(last_step: int) -> None:  # a peer died: save alone, no collective call
        save_checkpoint(ckpt_dir, last_step, state(), single_writer=True)

    with TrainerLink(allow_drills=True) as link:
        loaded = load_latest(ckpt_dir)
        step = 0 if loaded is None else loaded.step
        started = step
        if loaded is not None:
            model.load_state_dict(loaded.state["model"])
            optim.load_state_dict(loaded.state["optim"])
        while step < total:
            with link.rescue(rescue_save):
                flag = torch.tensor([float(link.stop_requested)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    save_checkpoint(ckpt_dir, step, state())
                    dist.destroy_process_group()
                    link.exit_for_resume()
                loss, grad_norm = forward_backward(step)
            optim.step()
            step += 1
            link.step(step, loss, grad_norm)
            time.sleep(args.step_sleep)
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"steps_done": step, "started_from": started}), flush=True)


if __name__ == "__main__":
    main()
