"""Another user reads no one else's ranks' pids, uids, jobs or roles, nor the daemon's state dir: mallory
(a throwaway local user) reads `/v1/trainers` and `/v1/daemon` over TCP, as anyone on the node can,
while root's rank reports. Root, reading the same, sees everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.conftest import local_users
from tests.inplace.jobs import sim_node
from tests.reporting import FakeRank

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user")

READ = """
import encodings.idna, json, os, socket, sys
uid, host, port = json.loads(sys.argv[1])
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)  # mallory, from here on
def get(path):
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(("GET %s HTTP/1.0\\r\\nHost: %s\\r\\n\\r\\n" % (path, host)).encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\\r\\n\\r\\n", 1)[1])
print(json.dumps({p: get(p) for p in ("/v1/trainers", "/v1/daemon")}))
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-privacy-mallory") as (user,):
        yield user.pw_uid


def get(base: str, path: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(base + path, timeout=10) as answer:
        return json.load(answer)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_another_user_sees_no_pid_job_or_role_of_others_and_root_sees_all(tmp_path: Path, mallory: int) -> None:
    with sim_node(tmp_path / "node", gpus=1) as node:
        rank = FakeRank()
        try:
            uuid = get(node.url, "/v1/gpus/0")["uuid"]
            assert rank.report(node.runtime_dir, t=time.time(), job_id="victim-job", gpu_uuid=uuid, step=3, spare=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not get(node.url, "/v1/trainers")["reports"]:
                time.sleep(0.2)
            as_root = {p: get(node.url, p) for p in ("/v1/trainers", "/v1/daemon")}
            host, _, port = node.url.removeprefix("http://").rpartition(":")
            target = json.dumps([mallory, host, int(port)])
            read = subprocess.run([sys.executable, "-c", READ, target], capture_output=True, text=True, timeout=60)
        finally:
            rank.end()
    assert read.returncode == 0, read.stderr[-2000:]
    as_mallory = json.loads(read.stdout)
    hers = [(r["pid"], r.get("job_id"), r.get("uid"), r.get("spare")) for r in as_mallory["/v1/trainers"]["reports"]]
    roots = [(r["pid"], r.get("job_id"), r.get("uid"), r.get("spare")) for r in as_root["/v1/trainers"]["reports"]]
    print(f"\nmallory reads {hers} and {as_mallory['/v1/daemon']}; root reads {roots}")
    assert roots == [(rank.pid, "victim-job", 0, True)]
    assert hers == [(0, None, None, None)]
    assert as_mallory["/v1/daemon"]["state_dir"] == "" and as_mallory["/v1/daemon"]["runtime_dir"]
    assert as_root["/v1/daemon"]["state_dir"]
