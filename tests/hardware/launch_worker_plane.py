"""A one-node launch's workers, started as torchrun starts them under `gpuwatch launch`, on NCCL as on gloo.

    python tests/hardware/launch_worker_plane.py --device cuda           # the GPU machine: NCCL, one rank per GPU
    python tests/hardware/launch_worker_plane.py --device cpu --small    # here: gloo, 2 ranks

The script hosts the launch's authenticated store (what gpuwatch.launcher.local_rendezvous hosts in
torchrun's agent) and starts each rank through the same entry (gpuwatch.launcher.worker_plane's
`python -c`, then gpuwatch.launcher.worker_store) with torchrun's variables. The job is an unmodified
script: `dist.init_process_group(BACKEND)` through env://, then `torch.cuda.set_device(LOCAL_RANK)`,
then --steps all-reduces. Printed (JSON, then a markdown table): backend, world, each rank's proof
verdict as the store holds it, whether every sum was right, and the seconds from start to the
script's first line after init (torch's import included) and in all. Under a minute on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = r"""
import json, os, sys, time
import torch, torch.distributed as dist
backend, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group(backend)
inited = time.time()
device = torch.device("cpu")
if backend == "nccl":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
right = True
for _ in range(steps):
    t = torch.ones(1024, device=device)
    dist.all_reduce(t)
    right = right and bool((t == dist.get_world_size()).all())
print("RESULT", json.dumps({"rank": dist.get_rank(), "right": right, "inited": inited}), flush=True)
dist.destroy_process_group()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--small", action="store_true", help="fewer steps (the CPU check)")
    args = parser.parse_args()
    import torch

    from gpuwatch.inplace.jobstore import StoreServer
    from gpuwatch.inplace.secret import read_secret
    from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV, secured_job_args, write_secret

    backend = "nccl" if args.device == "cuda" else "gloo"
    world = max(1, torch.cuda.device_count()) if backend == "nccl" else 2
    steps = 10 if args.small else 200
    with tempfile.TemporaryDirectory(prefix="gpuwatch-worker-plane-") as tmp:
        secret = write_secret(Path(tmp) / "secret")
        (Path(tmp) / "job.py").write_text(JOB)
        server = StoreServer("127.0.0.1", 0, read_secret(secret))
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": str(world)}
        env.update({WORKER_SECRET_ENV: str(secret), "LOCAL_WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo"})
        entry = secured_job_args([str(Path(tmp) / "job.py"), backend, str(steps)], sys.executable)[2:]
        start = time.time()
        ranks = [
            subprocess.Popen(
                entry,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in range(world)
        ]
        outs = [r.communicate(timeout=240) for r in ranks]
        total = time.time() - start
        keys = [f"default_pg/proof/0/verdict/{r}" for r in range(world)]
        verdicts = [server.data.get(k).decode() if server.data.check([k]) else None for k in keys]
        server.close()
    results = [
        json.loads(line.split("RESULT", 1)[1]) for out, _ in outs for line in out.splitlines() if "RESULT" in line
    ]
    said = {
        "backend": backend,
        "world": world,
        "verdicts": verdicts,
        "exits": [r.returncode for r in ranks],
        "sums_right": len(results) == world and all(r["right"] for r in results),
        "init_s": round(max((r["inited"] for r in results), default=start) - start, 2),
        "total_s": round(total, 2),
        "errors": [err.strip().splitlines()[-3:] for r, (_, err) in zip(ranks, outs, strict=True) if r.returncode],
    }
    print(json.dumps(said))
    print("| backend | world | verdicts | sums right | init s | total s |\n| --- | --- | --- | --- | --- | --- |")
    row = (backend, world, ", ".join(map(str, verdicts)), said["sums_right"], said["init_s"], said["total_s"])
    print("| " + " | ".join(map(str, row)) + " |")
    return 0 if said["sums_right"] and all(v == "ok" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
