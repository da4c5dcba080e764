"""Another local user cannot turn a job's host snapshots off, nor read them, by taking its directory's name first.

Two throwaway users: the squatter makes `gpuwatch-<victim uid>` in a sticky world-writable root
(what /dev/shm is) before the victim's job starts; the victim's job (a real process running as the
victim) still snapshots, a relaunch restores from memory, and the squatter can read nothing. The
daemon's watch counts the squat and removes the kind it can remove safely (a link).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.snapshots.prune import SquatWatch
from tests.hardening.conftest import local_users

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates two users")

REPO = Path(__file__).resolve().parents[2]
VICTIM_JOB = """
import json, os, sys, tempfile
import torch
from gpuwatch.snapshots import HostSnapshot

root, uid, gid, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
net = torch.nn.Linear(4, 2)
optim = torch.optim.SGD(net.parameters(), lr=0.1)

def train(snap, steps):
    for step in steps:
        net(torch.ones(1, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
        snap.step(step)

with tempfile.TemporaryDirectory() as warm:  # load every lazy import while still root (the interpreter is root's)
    snap = HostSnapshot(lambda: {"model": net.state_dict()}, every=1, optimizer=optim, job_id="warm", root=warm)
    train(snap, range(1, 3))
    snap.restore()
    snap.close(remove=True)
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
snap = HostSnapshot(lambda: {"model": net.state_dict()}, every=1, optimizer=optim, job_id="victim-job", root=root)
if mode == "train":
    train(snap, range(1, 5))
    snap.close(remove=False)  # as a rank that stops for a relaunch
    print(json.dumps({"enabled": snap.enabled, "reason": snap.disabled_reason}))
else:
    restored = snap.restore()
    snap.close(remove=False)
    print(json.dumps({"source": restored and restored.source, "where": restored and restored.where}))
"""


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    """(squatter, victim): two throwaway local accounts, removed at the end."""
    with local_users("gw-squatter", "gw-snapvictim") as (first, second):
        yield first, second


@pytest.fixture
def shm() -> Iterator[Path]:
    """A sticky, world-writable root like /dev/shm (the real one is left alone)."""
    root = Path(tempfile.mkdtemp(prefix="gpuwatch-shm-"))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _as(user: pwd.struct_passwd, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), user=user.pw_uid, group=user.pw_gid, extra_groups=[], capture_output=True,
                          text=True, timeout=30)  # fmt: skip


def _victim_job(shm: Path, victim: pwd.struct_passwd, mode: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [str(shm), str(victim.pw_uid), str(victim.pw_gid), mode]
    done = subprocess.run(
        [sys.executable, "-c", VICTIM_JOB, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.slow
def test_a_squatted_snapshot_dir_does_not_turn_snapshots_off(
    users: tuple[pwd.struct_passwd, pwd.struct_passwd], shm: Path
) -> None:
    squatter, victim = users
    squat = shm / f"gpuwatch-{victim.pw_uid}"
    assert _as(squatter, "mkdir", "-m", "0777", str(squat)).returncode == 0  # before the victim's first job

    trained = _victim_job(shm, victim, "train")
    relaunched = _victim_job(shm, victim, "restore")

    assert trained == {"enabled": True, "reason": None}
    assert relaunched["source"] == "memory", relaunched
    (private,) = [p for p in shm.iterdir() if p != squat]
    assert private.name.startswith(f"gpuwatch-{victim.pw_uid}-")
    assert private.stat().st_uid == victim.pw_uid and private.stat().st_mode & 0o777 == 0o700
    assert list(squat.iterdir()) == []  # nothing of the victim's went into the squatter's directory
    peek = _as(squatter, "ls", str(private / "job-victim-job"))
    assert peek.returncode != 0 and "Permission denied" in peek.stderr

    watch = SquatWatch()
    link = shm / "gpuwatch-4242"
    assert _as(squatter, "ln", "-s", "/etc", str(link)).returncode == 0
    removed = watch.look(shm)
    assert removed == [link] and not link.is_symlink() and Path("/etc/passwd").exists()
    assert (watch.standing, watch.removed) == (1, 1)  # the squatter's directory stays, counted
    assert squat.is_dir()
