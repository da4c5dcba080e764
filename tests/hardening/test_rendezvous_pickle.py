"""`gpuwatch launch` without --in-place: another local user can plant nothing in its rendezvous.

mallory (a throwaway local user) finds the launch's listening ports with `ss` and, on each, writes
what made torchrun's agent run her command as the victim: a pickle under the c10d rendezvous's
state key (`torch.rendezvous.<run id>`), again and again while the job runs. The job (2 gloo ranks,
sim daemon) must end with exit 0, nothing of hers must run, and every port must be on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.hardening.conftest import local_users
from tests.inplace.jobs import sim_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user"),
    pytest.mark.slow,
]
JOB = "victim-job"

TRAIN = """
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
for _ in range(40):
    t = torch.ones(1); dist.all_reduce(t); time.sleep(0.25)
print("done", dist.get_rank(), flush=True)
"""

MALLORY = r"""
import base64, datetime, json, os, pickle, sys, time
import torch.distributed as dist
uid, ports, job, marker = json.loads(sys.stdin.readline())
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
class Command:
    def __reduce__(self):
        return (os.system, (f"id -u > {marker}",))
state = base64.b64encode(pickle.dumps(Command())).decode()
reached, wrote = set(), 0
for _ in range(20):
    for port in ports:
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))
            reached.add(port)
            for key in (f"torch.rendezvous.{job}", f"{job}/torch.rendezvous.{job}"):
                store.set(key, state)
                wrote += 1
        except Exception:
            pass
    time.sleep(0.25)
print(json.dumps({"reached": sorted(reached), "writes": wrote}), flush=True)
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-rdzv-mallory") as (user,):
        yield user.pw_uid


def listening(pids: set[int]) -> list[tuple[str, int]]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            address, _, port = line.split()[3].rpartition(":")
            found.append((address, int(port)))
    return found


def family(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def launch_victim(
    node: DaemonProcess, job_dir: Path, rdzv_id: str, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """The victim's `gpuwatch launch` of job_dir/train.py, two ranks on the sim node, its output piped."""
    command = [
        sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
        "--rdzv-id", rdzv_id, "--nproc-per-node", "2", *options, "--", str(job_dir / "train.py"),
    ]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(command, cwd=job_dir, env=environ, text=True, **pipes)  # type: ignore[call-overload]


def attack_while_it_runs(
    job: subprocess.Popen[str], attack: str, payload: Callable[[list[int]], object]
) -> tuple[list[tuple[str, int]], str, str, tuple[str, str]]:
    """Once the launch listens, run `attack` (a root process that turns into mallory) with payload(ports)
    as its one stdin line: the ports, what she said (stdout, stderr), and the job's (stdout, stderr)."""
    ports: list[tuple[str, int]] = []
    deadline = time.monotonic() + 90
    while not ports and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.1)
        ports = listening(family(job.pid))
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    hers = subprocess.Popen([sys.executable, "-c", attack], text=True, **pipes)  # type: ignore[call-overload]
    said, err = hers.communicate(json.dumps(payload([p for _, p in ports])) + "\n", 120)
    return ports, said, err, job.communicate(timeout=120)


def test_a_pickle_written_to_the_launchs_rendezvous_runs_nothing(tmp_path: Path, mallory: int) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    marker = tmp_path / "ran-as-the-victim"
    tmp_path.chmod(0o755)
    with sim_node(tmp_path / "node", gpus=2) as node:
        job = launch_victim(node, tmp_path, JOB)
        try:
            ports, said, err, (_, stderr) = attack_while_it_runs(
                job, MALLORY, lambda ports: [mallory, ports, JOB, str(marker)]
            )
        finally:
            if job.poll() is None:
                job.kill()
    print(f"\nthe launch listens on {ports}; mallory: {said.strip()} {err.strip()[-300:]}")
    assert ports, "the launch listened nowhere before it ended: the attack proved nothing"
    assert not marker.exists(), f"mallory's pickle ran as the victim: uid {marker.read_text().strip()}"
    assert all(address == "127.0.0.1" for address, _ in ports), ports
    assert job.returncode == 0, stderr[-3000:]
