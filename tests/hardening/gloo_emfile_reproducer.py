"""Reproducer for gloo (pytorch/gloo, as shipped in torch): a listener's accept() failing with EMFILE
ends the whole process through GLOO_ENFORCE, so any local user who can connect to a rank's listener
can kill it with idle connections.

NOT FILED upstream yet (written where no network was reachable); this script is the report's
reproducer as it stands:

    python tests/hardening/gloo_emfile_reproducer.py

It starts a 2-rank gloo group (two processes, soft RLIMIT_NOFILE 256 each, a FileStore), finds the
TCP ports rank 0 listens on (its own sockets in /proc/self/fd and /proc/net/tcp{,6}), and then, as
a stranger would, this parent process opens 400 idle connections to each of those ports while the
ranks all-reduce. Expected: the ranks keep all-reducing (a server should drop or refuse a connection
it cannot accept). What gloo does: rank 0 aborts (SIGABRT, "terminate called after throwing an
instance of 'gloo::EnforceNotMet'", `accept: Too many open files`), and rank 1 then fails on its peer.
Prints one JSON line: each rank's exit code and the last lines of its stderr; exits 1 when a rank
was killed (the bug), 0 when both finished.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

RANK = r"""
import datetime, os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import torch, torch.distributed as dist
rank, store_file, ports_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
store = dist.FileStore(store_file, 2)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
if rank == 0:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, one of ours
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    with open(ports_file + ".tmp", "w") as out:
        out.write(" ".join(map(str, ports)))
    os.rename(ports_file + ".tmp", ports_file)
t = torch.ones(1)
for _ in range(100):
    dist.all_reduce(t)
    time.sleep(0.1)
print("rank", rank, "finished", flush=True)
"""

CONNECTIONS = 400


def main() -> int:
    work = tempfile.mkdtemp(prefix="gloo-emfile-")
    store_file, ports_file = os.path.join(work, "store"), os.path.join(work, "ports")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), store_file, ports_file],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 120
    while not os.path.exists(ports_file) and time.monotonic() < deadline and ranks[0].poll() is None:
        time.sleep(0.1)
    ports = [int(p) for p in open(ports_file).read().split()] if os.path.exists(ports_file) else []
    held: list[socket.socket] = []
    for port in ports:
        for _ in range(CONNECTIONS):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                break
    outs = [r.communicate(timeout=120) for r in ranks]
    for sock in held:
        sock.close()
    said = {
        "ports": ports,
        "connections": len(held),
        "ranks": [
            {"exit": rank.returncode, "stderr": err.strip().splitlines()[-3:]}
            for rank, (_, err) in zip(ranks, outs, strict=True)
        ],
    }
    print(json.dumps(said))
    return 0 if all(r.returncode == 0 for r in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
