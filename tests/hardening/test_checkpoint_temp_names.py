"""A save into a checkpoint directory others can write: mallory (a throwaway local user) plants, under
every temp name the saver's pid makes guessable, a link to the victim's file and a directory of
hers. The save must write through no link and must not fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.trainer.checkpoint import load_latest, save_checkpoint
from tests.hardening.conftest import local_users

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user")

PLANT = """
import os, sys
uid, shared, victim_file, pid = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
os.setgroups([]); os.setresgid(int(uid), int(uid), int(uid)); os.setresuid(int(uid), int(uid), int(uid))
os.symlink(victim_file, f"{shared}/latest.tmp-{pid}")
for step in range(1, 4):
    os.mkdir(f"{shared}/.tmp-step-{step}-{pid}")
print("planted")
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-ckpt-mallory") as (user,):
        yield user.pw_uid


def test_planted_temp_names_neither_redirect_nor_fail_a_save(mallory: int) -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="gw-ckpt-"))  # where mallory may reach, as a shared scratch dir
    tmp_path.chmod(0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a shared scratch directory
    victim_file = tmp_path / "precious"
    victim_file.write_text("the victim's data\n")
    planted = subprocess.run(
        [sys.executable, "-c", PLANT, str(mallory), str(shared), str(victim_file), str(os.getpid())],
        capture_output=True, text=True,
    )  # fmt: skip
    assert planted.stdout.strip() == "planted", planted.stderr
    for step in range(1, 4):
        save_checkpoint(shared, step, {"step": step, "w": [1.0, 2.0]})
    assert victim_file.read_text() == "the victim's data\n", "the save wrote through mallory's link"
    loaded = load_latest(shared)
    shutil.rmtree(tmp_path)
    assert loaded is not None and loaded.step == 3
