"""Which part of the host snapshots' set-up holds a step of the training loop, on one GPU.

    python3 -m gpuwatch.bench.snapshot_stall --gib 16    # about 2 minutes on one H100

`snapshot_cost` found the longest step of a 15.75 GiB loop (a 96 ms step) at 1.23 s, in the
slots' set-up window, and none after it. Two parts of the set-up can hold the training thread for
that long: the staging buffer's allocation (`prepare.allocate_staging`: one cudaMalloc of the
state's size, taken on the training thread at the first snapshot) and the snapshots taken into the
slots while they are mapped but not yet filled or pinned. This prints, on one clock from the
script's start:

* how long `torch.empty` of 1, 4 and 16 GiB takes on the GPU, on the loop's thread and beside a loop
  of matmuls (its longest step then), with torch's caching allocator holding its lock through the
  cudaMalloc (its default) and with `release_lock_on_cudamalloc`;
* every step of the snapshot loop (`HostSnapshot(every=8)` over `gpuwatch.bench.recovery_snapshots`'
  loop) slower than 1.5x a plain one, with its start and end, until the slots are ready and 40 steps
  more;
* each set-up part's start and end (the staging allocation, each slot's map, fill and pin), and
  gpuwatch.snapshots' own log lines.

A long step that spans `allocate_staging` is the allocation; one inside a fill or with no set-up part
beside it is a window snapshot. Nothing on the GPU is changed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

START = time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuwatch.bench.snapshot_stall", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--gib", type=float, default=16.0, help="the loop's state (parameters and AdamW's moments)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("snapshot_stall: no CUDA device here (this measures a GPU's set-up)", file=sys.stderr)
        return 2
    allocation(torch)
    set_up(torch, args.gib)
    return 0


def now() -> float:
    return time.perf_counter() - START


def allocation(torch: Any) -> None:
    """torch.empty of a staging buffer's size: alone, and beside a loop of matmuls (its longest step)."""
    device = torch.device("cuda:0")
    a, b = (torch.randn(4096, 4096, device=device) for _ in range(2))
    out = torch.empty_like(a)

    def step() -> float:
        started = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b, out=out)
            torch.empty(64 << 20, dtype=torch.uint8, device=device)  # the loop's own allocations, from the cache
        torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(5):
        step()
    plain = sorted(step() for _ in range(21))[10]
    print(f"allocation: a plain step {plain * 1e3:.1f} ms", flush=True)
    for gib in (1, 4, 16):
        started = time.perf_counter()
        buffer = torch.empty(gib << 30, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        print(f"allocation: torch.empty({gib} GiB) {1e3 * (time.perf_counter() - started):.1f} ms", flush=True)
        del buffer
        torch.cuda.empty_cache()
    for how in ("the allocator's lock held", "release_lock_on_cudamalloc"):
        if how == "release_lock_on_cudamalloc":
            torch.cuda.memory._set_allocator_settings("release_lock_on_cudamalloc:True")
        held: list[Any] = []
        beside = threading.Thread(target=_allocate, args=(torch, held, device))
        beside.start()
        spans = [step()]
        while beside.is_alive():
            spans.append(step())
        print(f"allocation: 16 GiB beside the loop ({how}): its longest step {max(spans) * 1e3:.1f} ms", flush=True)
        held.clear()
        torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("release_lock_on_cudamalloc:False")


def _allocate(torch: Any, held: list[Any], device: Any) -> None:
    held.append(torch.empty(16 << 30, dtype=torch.uint8, device=device))


def set_up(torch: Any, gib: float) -> None:
    """Every slow step of a fresh HostSnapshot's set-up window, beside each set-up part's span."""
    from gpuwatch.bench import recovery_snapshots as rs
    from gpuwatch.snapshots import HostSnapshot, prepare, slot

    _timed(prepare, "allocate_staging")
    for name in ("map_sparse", "fill", "pin"):
        _timed(slot.Slot, name)
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8d ms %(name)s %(message)s", stream=sys.stdout)
    torch.backends.cuda.matmul.allow_tf32 = True
    loop = rs.build(gib, torch.device("cuda:0"), 2048, rs.WIDTH)
    plain = sorted(rs._timed(loop, 31, None))[15]
    print(f"set-up: a plain step {plain * 1e3:.1f} ms; the loop built at {now():.3f} s", flush=True)
    snap = HostSnapshot(loop.state, every=8, optimizer=loop.optim, replicated=True, job_id="snapshot-setup-stall")
    steps, after_ready = 0, 0
    try:
        while snap.enabled and after_ready < 40 and steps < 5000:
            started = now()
            loop.train_step()
            snap.step(loop.step)
            spent = now() - started
            steps += 1
            after_ready += snap.ready_step is not None
            if spent > 1.5 * plain:
                print(f"step {steps} [{started:9.3f} - {started + spent:9.3f}] {spent * 1e3:.1f} ms "
                      f"({spent / plain:.1f}x), slots ready: {snap.ready_step is not None}", flush=True)  # fmt: skip
        print(f"set-up: the slots were ready at step {snap.ready_step} of {steps}", flush=True)
    finally:
        snap.close(remove=True)


def _timed(owner: Any, name: str) -> None:
    """Wrap owner.name so that each call prints its span on the script's clock."""
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = now()
        try:
            return inner(*args, **kwargs)
        finally:
            print(f"  [{started:9.3f} - {now():9.3f}] {name}", flush=True)

    setattr(owner, name, timed)


if __name__ == "__main__":
    sys.exit(main())
