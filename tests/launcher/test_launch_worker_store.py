"""A one-node launch's workers start through gpuwatch.launcher.worker_store: env:// reaches the launch's
authenticated store, the default group proves itself, and the job runs as `python [-m] SCRIPT` would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV, secured_job_args, write_secret

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # real worker processes (torch's import: seconds each on a loaded machine)
from gpuwatch.inplace.jobstore import StoreServer  # noqa: E402  (needs torch)
from gpuwatch.inplace.secret import read_secret  # noqa: E402

INIT = 'dist.init_process_group("gloo")'
MESH = 'from torch.distributed.device_mesh import init_device_mesh; init_device_mesh("cpu", (2,))'
JOB = f"""
import sys, torch, torch.distributed as dist
{INIT}
t = torch.ones(1); dist.all_reduce(t)
print("sum", t.item(), "argv", sys.argv[1:], "path0", sys.path[0] == __import__("os").path.dirname(__file__))
"""


def _workers(
    argv: list[str], tmp_path: Path, port: int, secret: Path, world: int = 2, env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    entry = secured_job_args(argv, sys.executable)[2:]  # what torchrun starts with --no-python
    env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    env.update({WORKER_SECRET_ENV: str(secret), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": tmp_path}
    return [
        subprocess.Popen(entry, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, **pipes)  # type: ignore[call-overload]
        for r in range(world)
    ]


@pytest.mark.parametrize("init", [INIT, MESH], ids=["init_process_group", "init_device_mesh"])
def test_env_init_meets_in_the_launchs_store_and_the_group_proves_itself(tmp_path: Path, init: str) -> None:
    secret = write_secret(tmp_path / "secret")
    (tmp_path / "torch.py").write_text("raise SystemExit('the working directory was imported from')\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "job.py").write_text(JOB.replace(INIT, init))
    server = StoreServer("127.0.0.1", 0, read_secret(secret))
    try:
        workers = _workers(["sub/job.py", "--lr", "3"], tmp_path, server.port, secret)
        outs = [w.communicate(timeout=120) for w in workers]
        keys = [f"default_pg/proof/0/verdict/{r}" for r in (0, 1)]
        verdicts = [server.data.get(k) if server.data.check([k]) else None for k in keys]
    finally:
        server.close()
    for out, err in outs:
        assert out.strip() == "sum 2.0 argv ['--lr', '3'] path0 True", err[-2000:]
    assert verdicts == [b"ok", b"ok"]  # each rank proved the secret over the group before the job used it


def test_a_worker_without_the_secret_never_reaches_the_store(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    server = StoreServer("127.0.0.1", 0, os.urandom(32).hex().encode())
    try:
        wrong = write_secret(tmp_path / "other-secret")
        outs = [(w.wait(timeout=120), w.communicate()[1]) for w in _workers(["job.py"], tmp_path, server.port, wrong)]
        keys = server.data.num_keys()
    finally:
        server.close()
    for code, err in outs:
        assert code != 0 and "did not prove" in err, err[-2000:]
    assert keys == 0
