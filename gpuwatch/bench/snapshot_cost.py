"""What host snapshots cost a one-GPU training loop, mode by mode (run on a GPU machine; CPU in a reduced mode).

    python3 -m gpuwatch.bench.snapshot_cost --device cuda        # 4 and 16 GiB, 300 steps a run
    python3 -m gpuwatch.bench.snapshot_cost --device cpu --small  # the same, tiny (~10 s)

The GPU run is about 6 minutes on one H100. `gpuwatch bench --only recovery` measures one mode beside
the recovery paths; this measures every mode, the GPU nearly full, and the restore.

Needs torch and gpuwatch.snapshots only. Per state size (fp32 Linear stack built on the CPU with the
default init, then moved; AdamW; HostSnapshot(..., optimizer=opt, replicated=True)): no snapshots, every 8,
every 4, auto, each --steps steps (gpuwatch.bench.recovery_snapshots): wall time and steady mean step
against the plain loop, the longest step (the every-8 run includes the slots' set-up, also shown apart),
the GPU memory the snapshots hold and their peak extra, K, the mode, the cost_share stats() reports and the
steps a death may lose. At the last size also: the GPU nearly full (a ballast leaves less free memory than
the state's size, taken beside the loop's own peak; a CUDA out-of-memory shrinks it and tries again) with
snapshots every 8, and a snapshot restored onto the GPU in process (its CUDA
context up) and loaded. Prints a markdown table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.bench.snapshot_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny sizes and few steps (a check of the script)")
    parser.add_argument("--gib", type=float, nargs="*", help="state sizes (default 4 16; --small: 0.01 0.03)")
    parser.add_argument("--steps", type=int, help="steps a run (default 300; --small: 24)")
    parser.add_argument("--batch", type=int, help="rows a step (default 2048; --small: 16)")
    args = parser.parse_args()
    import torch

    from gpuwatch.bench import recovery_snapshots as rs

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu --small)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)  # a shared CPU machine: torch's thread pool spins against the load
    sizes = args.gib or ([0.01, 0.03] if args.small else [4.0, 16.0])
    steps = args.steps or (24 if args.small else 300)
    batch = args.batch or (16 if args.small else 2048)
    width = 256 if args.small else rs.WIDTH
    started = time.perf_counter()
    table: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    for n, gib in enumerate(sizes):
        job = f"snapshot-cost-{os.getpid()}-{n}"
        loop = rs.build(gib, device, batch, width)
        state_gib = loop.state_bytes / 2**30
        print(
            f"== {state_gib:.2f} GiB of state ({time.perf_counter() - started:.0f} s in)", file=sys.stderr, flush=True
        )
        runs = rs.measure_modes(loop, steps, job)
        table += rs.rows(state_gib, runs)
        print(rs.markdown(rs.rows(state_gib, runs)), file=sys.stderr, flush=True)  # kept if a later part runs out
        if n == len(sizes) - 1:
            full, ballast = rs.nearly_full(loop, steps, job)
            table += rs.rows(state_gib, [full], plain=runs[0])
            extra["nearly_full_ballast_gib"] = ballast / 2**30
            extra["restore"] = rs.restore_time(loop, job)
        rs.cleanup(job)
        del loop
        rs._empty_cache(device)
    print(rs.markdown(table))
    restore = extra.get("restore", {})
    if "restore_s" in restore:
        said = f"restore() {restore['restore_s']:.2f} s, with load_state_dict {restore['restore_and_load_s']:.2f} s"
        print(f"\nrestore of {restore['gib']:.2f} GiB onto {device} in process: {said}, exact: {restore['exact']}")
    print(json.dumps({"device": str(device), "card": _card(device), "steps": steps, "batch": batch, "rows": table,
                      **extra, "total_s": time.perf_counter() - started}))  # fmt: skip
    return 0


def _card(device: object) -> str:
    import torch

    return torch.cuda.get_device_name(0) if str(device).startswith("cuda") else "cpu"


if __name__ == "__main__":
    sys.exit(main())
