"""A spare's warm-up never imports from the launch's working directory: mallory (a throwaway local
user) leaves a `torch.py` in a shared directory the victim launches from; the victim's spare warms up
(imports torch) there and takes the job over. Nothing of hers may run; the job's own module, in that
directory, still runs as `python -m` would run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hardening.conftest import local_users
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user")

PLANT = """
import os, sys
uid, shared = int(sys.argv[1]), sys.argv[2]
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
with open(os.path.join(shared, "torch.py"), "w") as f:
    f.write("import os\\nopen(os.path.join(os.path.dirname(__file__), 'ran-as-' + str(os.getuid())), 'w').close()\\n")
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-spare-mallory") as (user,):
        yield user.pw_uid


@pytest.mark.slow
def test_a_torch_py_in_the_working_directory_never_runs_in_the_spare(mallory: int) -> None:
    shared = Path(tempfile.mkdtemp(prefix="gw-spare-"))
    try:
        shared.chmod(0o1777)  # a shared scratch directory
        subprocess.run([sys.executable, "-c", PLANT, str(mallory), str(shared)], check=True)
        (shared / "myjob.py").write_text("import torch\nprint('job ran with', torch.__name__, hasattr(torch, 'nn'))\n")
        order = '{"argv": ["-m", "myjob"], "env": {"PATH": "/usr/bin:/bin"}}\n'
        spare = subprocess.run(
            [sys.executable, "-m", "gpuwatch.spares.worker"], input=order, cwd=shared, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
        )  # fmt: skip
        planted_ran = sorted(p.name for p in shared.glob("ran-as-*"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    print(f"\nthe spare: exit {spare.returncode}, {spare.stdout.strip()!r}; mallory's torch.py ran: {planted_ran}")
    assert planted_ran == [], "mallory's torch.py ran in the victim's spare"
    assert spare.returncode == 0 and spare.stdout.strip() == "job ran with torch True", spare.stderr[-2000:]
