"""Each new process group proves the job's secret before it carries state, on NCCL as on gloo.

    python tests/hardware/group_proof.py --device cuda           # the GPU machine: NCCL, one rank per GPU
    python tests/hardware/group_proof.py --device cpu --small    # here: gloo, 2 ranks
    python tests/hardware/group_proof.py --device cuda --subgroups   # later groups over NCCL (2+ GPUs)
    python tests/hardware/group_proof.py --device cpu --subgroups    # here: the same over gloo

The script hosts the job's authenticated store (gpuwatch.inplace.jobstore) and starts one rank per
GPU (2 on CPU). Every rank forms the group through `form_group` (the nonces through the store, the
HMACs in one all-gather over the group), the source rank sends a model's and AdamW's state with
`send_state` (the header as JSON), and every rank checks that it holds the source's checksum.
Then the ranks form the group --rounds more times, as a job does at each membership change, and
the proof's cost is timed. Printed (JSON, then a markdown table): backend, world, the attempt the
first group held at (0: at once), the proof's median and worst seconds over the rounds (init
included), the state's bytes and whether every rank holds the source's state. With one GPU the
world is 1 (the proof of a group of one: still its nonce, all-gather and verdict).

With --subgroups, the groups a job makes after its default group (gpuwatch.inplace.subgroups): two
ranks (one per GPU, NCCL; gloo on CPU) form the default group with the device bound, then make
`new_group([0, 1])` (proved over the new group, its tensors on the GPU), a second one for which rank
1's first proof uses a wrong secret (refused on both ranks, one line and a count, formed again), and
with NCCL `split_group` (what a DeviceMesh uses when the device is bound). Each group all-reduces
rank+1; printed: each group's sum, how many were refused, the proof's seconds. On a machine with
one GPU it says so and exits 0 (a subgroup of NCCL ranks needs two).
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

SUB_RANK = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from gpuwatch.inplace import groupproof, subgroups
from gpuwatch.inplace.jobstore import JobStore
rank, world, port, secret, backend = json.loads(sys.argv[1])
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
options = {}
if backend == "nccl":
    torch.cuda.set_device(device)
    options = {"device_id": device}
store = JobStore("127.0.0.1", port, secret.encode(), datetime.timedelta(seconds=120))
timeout = datetime.timedelta(seconds=60)
groupproof.form_group(backend, store, "pg/1", rank, world, timeout, secret.encode(), device, "generation 1", options)
subgroups.install()
out = {"rank": rank}
def use(name, make):
    t0 = time.monotonic()
    try:
        group = make()
        made_s = time.monotonic() - t0
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t, group=group)
        out[name] = {"sum": t[0].item(), "s": round(made_s, 3)}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
use("new_group", lambda: dist.new_group(list(range(world))))
real = groupproof._prove
left = [1 if rank == 1 else 0]
def once_wrong(store, secret, *args):
    if left[0]:
        left[0] -= 1
        secret = b"not the job's secret"
    return real(store, secret, *args)
groupproof._prove = once_wrong
use("new_group_forged_once", lambda: dist.new_group(list(range(world))))
groupproof._prove = real
if backend == "nccl":
    use("split_group", lambda: dist.split_group(split_ranks=[list(range(world))]))
out["refused"] = groupproof.refused()
print(json.dumps(out), flush=True)
"""


def subgroups_main(device: str) -> None:
    """The later groups' proof between two ranks (NCCL on two GPUs, gloo on CPU)."""
    import torch

    from gpuwatch.inplace.jobstore import StoreServer

    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        print(f"--subgroups needs 2 GPUs for NCCL ranks; this machine has {torch.cuda.device_count()}: nothing run")
        return
    world, secret = 2, os.urandom(32).hex()
    server = StoreServer("127.0.0.1", 0, secret.encode())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", SUB_RANK, json.dumps([r, world, server.port, secret, backend])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    results = [p.communicate(timeout=300) for p in ranks]
    server.close()
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    lines = [line for _, err in results for line in err.splitlines() if "did not prove itself" in line]
    names = [k for k in outs[0] if k not in ("rank", "refused")]
    expected = float(sum(range(1, world + 1)))
    table = {
        name: {
            "sums": [o[name].get("sum") for o in outs],
            "proof_s": max(o[name].get("s", 0) for o in outs),
            "error": next((o[name]["error"] for o in outs if "error" in o[name]), None),
        }
        for name in names
    }
    ok = all(v["sums"] == [expected] * world for v in table.values()) and [o["refused"] for o in outs] == [1, 1]
    result = {"backend": backend, "world": world, "groups": table, "refused": [o["refused"] for o in outs],
              "refusal_lines": len(lines), "ok": ok, "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
    print(json.dumps(result))
    print("| group | sums | proof s | error |\n| --- | --- | --- | --- |")
    for name, v in table.items():
        print(f"| {name} | {v['sums']} | {v['proof_s']} | {v['error'] or ''} |")
    if lines:
        print(lines[0])
    if not ok:
        for _, err in results:
            print(err[-2000:], file=sys.stderr)
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model and 3 rounds (a quick check)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--subgroups", action="store_true", help="the groups made after the default group")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if args.subgroups:
        subgroups_main(args.device)
        return
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
