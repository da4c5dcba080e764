"""A rank that exits without destroying its proved group has it destroyed before the interpreter tears down.

Left to the interpreter's teardown, a gloo group over the job's store now and then ends the process
with SIGABRT, which its launcher counts as a crash (groupproof._destroy_at_exit). Exit handlers run
last registered first: one registered before the group forms runs after gpuwatch's and sees what
it left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a real rank process (torch's import: seconds on a loaded machine)
from gpuwatch.inplace.jobstore import StoreServer  # noqa: E402  (needs torch)
from tests.helpers import REPO  # noqa: E402

RANK = r"""
import atexit, datetime, json, sys
import torch, torch.distributed as dist
from gpuwatch.inplace.groupproof import form_group
from gpuwatch.inplace.jobstore import JobStore
port, secret, destroy = json.loads(sys.argv[1])
atexit.register(lambda: print(json.dumps({"alive_at_exit": dist.is_initialized()}), flush=True))
job = JobStore("127.0.0.1", port, secret.encode(), datetime.timedelta(seconds=30))
timeout = datetime.timedelta(seconds=30)
form_group("gloo", job, "pg/1", 0, 1, timeout, secret.encode(), torch.device("cpu"), "generation 1")
t = torch.ones(2)
dist.all_reduce(t)
print(json.dumps({"sum": t.sum().item()}), flush=True)
if destroy:
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("job_destroys", [False, True], ids=["left-alive", "destroyed-by-the-job"])
def test_a_proved_group_is_gone_before_the_interpreter_tears_down(job_destroys: bool) -> None:
    secret = os.urandom(16).hex()
    server = StoreServer("127.0.0.1", 0, secret.encode())
    try:
        done = subprocess.run(
            [sys.executable, "-c", RANK, json.dumps([server.port, secret, job_destroys])],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        server.close()
    said = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stderr[-2000:]
    assert said == [{"sum": 2.0}, {"alive_at_exit": False}], done.stderr[-2000:]
