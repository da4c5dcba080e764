"""Idle connections from another user do not end a gloo rank: mallory (a throwaway local user) finds
the ranks of an in-place job (2 ranks, sim daemon) listening with `ss` and holds 1,100 idle
connections to every port each rank listens on. Before, a rank at the usual soft descriptor limit
(1024, as systemd gives a login's processes) ran out in gloo's accept() and gloo ended it. The job
is started at that soft limit and must end with exit 0, every step once on every rank, generation 1
throughout.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.conftest import local_users
from tests.hardening.test_inplace_trust import listening
from tests.helpers import launch_env
from tests.inplace.jobs import InPlaceRun, assert_no_step_lost_or_repeated, sim_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user"),
    pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096, reason="needs a hard limit >= 4096"),
    pytest.mark.slow,
]
STEPS = 300
EACH = 1100

ATTACK = """
import json, os, resource, socket, sys, time
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # her own to take
uid, ports, each = json.loads(sys.stdin.readline())
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
held, failed = [], 0
for port in ports:
    for _ in range(each):
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
            held.append(s)
        except OSError:
            failed += 1
            s.close()
print(json.dumps({"held": len(held), "failed": failed}), flush=True)
sys.stdin.readline()  # hold them until the job ends
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-idle-mallory") as (user,):
        yield user.pw_uid


def login_soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))


def test_idle_connections_from_another_user_end_no_rank(tmp_path: Path, mallory: int) -> None:
    with sim_node(tmp_path / "node", gpus=2) as node:
        logs = tmp_path / "ckpt"
        command = [
            sys.executable, "-m", "gpuwatch", "launch", *node.cli_args, "--runtime-dir", str(node.runtime_dir),
            "--in-place", "--", "-m", "gpuwatch.examples.trainer", "--in-place", "--ckpt-dir", str(logs),
            "--steps", str(STEPS), "--step-sleep", "0.05", "--report-interval", "0.2", "--gloo-timeout", "20",
            "--ckpt-every", "1000",
        ]  # fmt: skip
        process = subprocess.Popen(
            command, env=launch_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=login_soft_limit,
        )  # fmt: skip
        run = InPlaceRun(process, logs)
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        attack = subprocess.Popen([sys.executable, "-c", ATTACK], text=True, **pipes)  # type: ignore[call-overload]
        try:
            run.wait_for("2 ranks past step 20", lambda lines: len(run.ranks_at(20, 2)) == 2)
            pids = sorted({ln["pid"] for ln in run.steps()})
            ports = sorted({port for pid in pids for _, port in listening(pid)})
            assert attack.stdin is not None and attack.stdout is not None
            attack.stdin.write(json.dumps([mallory, ports, EACH]) + "\n")
            attack.stdin.flush()
            said = json.loads(attack.stdout.readline())
            attacked_at = max(ln["step"] for ln in run.steps())
            _, stderr = run.output(120)
        finally:
            if attack.poll() is None:
                attack.kill()
            if process.poll() is None:
                run.stop()
    print(f"\nmallory held {said['held']} idle connections to the ranks' ports {ports} at step {attacked_at}")
    assert said["held"] >= EACH * len(ports) // 2, said
    assert attacked_at < STEPS, "the attack ended after the job: it proved nothing"
    assert process.returncode == 0, stderr
    lines = run.steps()
    assert sorted({ln["pid"] for ln in lines}) == pids, "a rank was ended"
    assert {ln["generation"] for ln in lines} == {1}, "the membership changed"
    assert_no_step_lost_or_repeated(lines, pids)
