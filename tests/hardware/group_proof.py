"""Each new process group proves the job's secret before it carries state, on NCCL as on gloo.

    python tests/hardware/group_proof.py --device cuda           # the GPU machine: NCCL, one rank per GPU
    python tests/hardware/group_proof.py --device cpu --small    # here: gloo, 2 ranks

The script hosts the job's authenticated store (gpuwatch.inplace.jobstore) and starts one rank per
GPU (2 on CPU). Every rank forms the group through `form_group` (the nonces through the store, the
HMACs in one all-gather over the group), the source rank sends a model's and AdamW's state with
`send_state` (the header as JSON), and every rank checks that it holds the source's checksum.
Then the ranks form the group --rounds more times, as a job does at each membership change, and
the proof's cost is timed. Printed (JSON, then a markdown table): backend, world, the attempt the
first group held at (0: at once), the proof's median and worst seconds over the rounds (init
included), the state's bytes and whether every rank holds the source's state. With one GPU the
world is 1 (the proof of a group of one: still its nonce, all-gather and verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RANK = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from gpuwatch.inplace.groupproof import form_group, refused
from gpuwatch.inplace.jobstore import JobStore
from gpuwatch.inplace.transfer import checksum, send_state
rank, world, port, secret, backend, rounds, width = json.loads(sys.argv[1])
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
store = JobStore("127.0.0.1", port, secret.encode(), datetime.timedelta(seconds=120))
timeout = datetime.timedelta(seconds=60)
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8)).to(device)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
if rank == 0:
    model(torch.randn(4, width, device=device)).sum().backward()
    optim.step()
started = time.monotonic()
attempt = form_group(backend, store, "pg/1", rank, world, timeout, secret.encode(), device, "generation 1")
first_s = time.monotonic() - started
step, moved = send_state(model, optim, {}, 5 if rank == 0 else -1, 0)
digest = checksum(model)
times = []
for g in range(2, 2 + rounds):
    dist.destroy_process_group()
    t0 = time.monotonic()
    form_group(backend, store, f"pg/{g}", rank, world, timeout, secret.encode(), device, f"generation {g}")
    times.append(time.monotonic() - t0)
dist.destroy_process_group()
print(json.dumps({"rank": rank, "attempt": attempt, "first_s": first_s, "times": times, "step": step,
                  "moved": moved, "checksum": digest, "refused": refused()}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model and 3 rounds (a quick check)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import torch

    from gpuwatch.inplace.jobstore import StoreServer

    backend = "nccl" if args.device == "cuda" else "gloo"
    world = max(1, torch.cuda.device_count()) if backend == "nccl" else 2
    rounds, width = (3, 256) if args.small else (args.rounds, 4096)
    secret = os.urandom(32).hex()
    server = StoreServer("127.0.0.1", 0, secret.encode())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, json.dumps([r, world, server.port, secret, backend, rounds, width])],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in ranks]
    server.close()
    times = [t for o in outs for t in o["times"]]
    result = {
        "backend": backend,
        "world": world,
        "first_group_attempt": max(o["attempt"] for o in outs),
        "refused": sum(o["refused"] for o in outs),
        "first_group_s": round(max(o["first_s"] for o in outs), 3),
        "reform_median_s": round(statistics.median(times), 4) if times else None,
        "reform_max_s": round(max(times), 4) if times else None,
        "state_bytes": outs[0]["moved"],
        "same_state_on_every_rank": len({o["checksum"] for o in outs}) == 1 and all(o["step"] == 5 for o in outs),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result))
    print("| " + " | ".join(result) + " |")
    print("|" + " --- |" * len(result))
    print("| " + " | ".join(str(v) for v in result.values()) + " |")
    if not result["same_state_on_every_rank"] or result["refused"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
