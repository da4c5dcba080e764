"""Real deaths and real users: a rank killed between a snapshot's copy and its commit, another local
user trying to read a job's snapshot, and the daemon's prune of a dead job's slots (and its traps)."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.snapshots import DIE_BEFORE_COMMIT_ENV, HostSnapshot
from gpuwatch.snapshots.prune import prune
from gpuwatch.snapshots.slot import COMMITTED, HEADER_LEN, WRITING

REPO = Path(__file__).resolve().parents[2]
JOB = "deaths"

RANK = r"""
import sys, torch
from gpuwatch.snapshots import HostSnapshot
root, every, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
net = torch.nn.Linear(64, 64)
optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
snap = HostSnapshot(lambda: {"model": net.state_dict(), "optim": optim.state_dict()}, every=every,
                    optimizer=optim, job_id="deaths", root=root)
for step in range(1, steps + 1):
    net(torch.ones(4, 64)).sum().backward()
    optim.step()
    optim.zero_grad()
    snap.step(step)
    print(step, flush=True)
snap.wait()
print("done", flush=True)
sys.stdin.read()  # stay alive (a rank of a running job) until the test closes stdin or kills it
"""


def _rank(root: Path, every: int, steps: int, **env: str) -> subprocess.Popen[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    command = [sys.executable, "-c", RANK, str(root), str(every), str(steps)]
    return subprocess.Popen(command, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(
        f"the rank exited {proc.wait()} before printing {line!r}: {proc.stderr.read() if proc.stderr else ''}"
    )


def _job_dir(root: Path) -> Path:
    return root / f"gpuwatch-{os.getuid()}" / f"job-{JOB}"


def _slot_state(path: Path) -> int:
    return int(struct.unpack_from("<I", path.read_bytes()[:HEADER_LEN], 12)[0])


@pytest.mark.slow
def test_a_death_between_the_copy_and_the_commit_never_loads_the_torn_slot(tmp_path: Path) -> None:
    rank = _rank(tmp_path, 3, 100, **{DIE_BEFORE_COMMIT_ENV: "6"})
    _, stderr = rank.communicate(timeout=120)

    assert rank.returncode == -signal.SIGKILL, stderr
    assert f"{DIE_BEFORE_COMMIT_ENV}=6: dying before the slot's commit" in stderr
    slots = sorted(_job_dir(tmp_path).iterdir())
    states = sorted(_slot_state(p) for p in slots)
    assert states == sorted([COMMITTED, WRITING])  # step 3 committed; step 6 copied, never committed
    torn = next(p for p in slots if _slot_state(p) == WRITING)
    assert any(torn.read_bytes()[HEADER_LEN : HEADER_LEN + 8])  # its payload was written (the copy ran)

    restored = HostSnapshot(dict, every=3, job_id=JOB, root=str(tmp_path)).restore()
    assert restored is not None and restored.step == 3


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """A throwaway local user (useradd), removed afterwards; the test is skipped when not root."""
    if os.getuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make another local user")
    name = f"gwsnap{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.mark.slow
def test_another_user_cannot_open_the_snapshot(other_user: pwd.struct_passwd) -> None:
    root = Path(tempfile.mkdtemp(prefix="gwsnap-test-", dir="/dev/shm"))  # a root the other user can reach
    root.chmod(0o1777)  # world-writable and sticky, like /dev/shm itself
    rank = _rank(root, 2, 4)
    try:
        _wait_for(rank, "done")
        slot = next(_job_dir(root).iterdir())

        def as_other(*command: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                list(command), user=other_user.pw_uid, group=other_user.pw_gid, extra_groups=[],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip

        reach = as_other("ls", str(root))  # the root itself is open to everyone: what is refused is ours
        reads = [
            as_other("cat", str(slot)),
            as_other("ls", str(_job_dir(root))),
            as_other("ls", str(_job_dir(root).parent)),
        ]
        modes = [p.stat().st_mode & 0o777 for p in (slot, _job_dir(root), _job_dir(root).parent)]
    finally:
        rank.kill()
        rank.communicate()
        shutil.rmtree(root, ignore_errors=True)
    assert reach.returncode == 0 and reach.stdout.split() == [f"gpuwatch-{os.getuid()}"], reach.stderr
    for result in reads:
        assert result.returncode != 0 and "Permission denied" in result.stderr, result
    assert modes == [0o600, 0o700, 0o700]


@pytest.mark.slow
def test_the_daemon_prunes_a_dead_jobs_slots_after_the_grace_period(tmp_path: Path) -> None:
    rank = _rank(tmp_path, 2, 6)
    _wait_for(rank, "done")
    rank.kill()  # SIGKILL: a death with no survivor, the slots stay for a relaunch
    rank.communicate()
    job_dir = _job_dir(tmp_path)
    assert len(list(job_dir.iterdir())) == 2
    last_write = max(p.stat().st_mtime for p in [job_dir, *job_dir.iterdir()])
    uid = os.getuid()

    assert prune(tmp_path, {(uid, JOB)}, now=last_write + 10_000, grace_s=60) == []  # a live rank of the job: kept
    assert prune(tmp_path, set(), now=last_write + 30, grace_s=60) == []  # dead, but a relaunch may still come
    removed = prune(tmp_path, set(), now=last_write + 61, grace_s=60)

    assert sorted(removed) == sorted([*(job_dir / f"rank-00000.slot{k}" for k in (0, 1)), job_dir])
    assert not job_dir.exists() and job_dir.parent.is_dir()


def test_prune_follows_no_symlink_and_leaves_other_users_files_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make files another uid owns (the daemon's situation)")
    uid, other = 4242, 4343
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "rank-00000.slot0"
    precious.write_text("not a snapshot")
    root = tmp_path / "shm"
    user_dir = root / f"gpuwatch-{uid}"

    def make(path: Path, owner: int, *, file: bool = False) -> Path:
        if file:
            path.write_text("x")
        else:
            path.mkdir(parents=True)
        os.chown(path, owner, owner)
        return path

    make(user_dir, uid)
    dead = make(user_dir / "job-dead", uid)
    make(dead / "rank-00000.slot0", uid, file=True)
    (dead / "rank-00000.slot1").symlink_to(precious)  # a link named like a slot: never followed
    os.chown(dead / "rank-00000.slot1", uid, uid, follow_symlinks=False)
    make(dead / "rank-00001.slot0", other, file=True)  # a file of another uid in the job dir: not ours to remove
    make(dead / "notes.txt", uid, file=True)  # not a slot name
    foreign_job = make(user_dir / "job-foreign", other)  # a job dir of another uid inside the user's dir
    make(foreign_job / "rank-00000.slot0", other, file=True)
    trap_user = make(root / f"gpuwatch-{other + 1}", other)  # named for uid 4344, owned by 4343
    make(trap_user / "job-x", other)
    make(trap_user / "job-x" / "rank-00000.slot0", other, file=True)
    (root / f"gpuwatch-{other + 2}").symlink_to(outside)  # a user dir that is a link
    (user_dir / "job-linked").symlink_to(outside)  # a job dir that is a link
    old = time.time() - 7200
    for path in [*root.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)

    with caplog.at_level(logging.WARNING, logger="gpuwatch.snapshots"):
        removed = prune(root, set(), now=time.time(), grace_s=60)

    assert removed == [dead / "rank-00000.slot0"]
    assert precious.read_text() == "not a snapshot" and (dead / "rank-00000.slot1").is_symlink()
    assert sorted(p.name for p in dead.iterdir()) == ["notes.txt", "rank-00000.slot1", "rank-00001.slot0"]
    assert (foreign_job / "rank-00000.slot0").exists() and (trap_user / "job-x" / "rank-00000.slot0").exists()
    assert sorted(p.name for p in outside.iterdir()) == ["rank-00000.slot0"]
    text = caplog.text
    assert f"{foreign_job} belongs to uid {other}, not {uid}: left alone" in text
    assert f"{trap_user} belongs to uid {other}, not {other + 1}: left alone" in text
    assert f"{root / f'gpuwatch-{other + 2}'} is not a directory (a symlink or a file): left alone" in text
    assert f"{user_dir / 'job-linked'} is not a directory (a symlink or a file): left alone" in text
    assert f"{dead / 'rank-00000.slot1'} is not a slot file of uid {uid}: left alone" in text


def test_the_running_daemon_prunes_a_dead_jobs_slots_and_keeps_a_live_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wired as in production: each minute the daemon prunes, with its own ranks as the live jobs."""
    from gpuwatch.snapshots.layout import job_dir_name, user_dir_name
    from tests.helpers import start_sim_node
    from tests.reporting import FakeRank

    root = tmp_path / "shm"
    monkeypatch.setenv("GPUWATCH_SNAPSHOT_ROOT", str(root))
    uid = os.getuid()
    user_dir = root / user_dir_name(uid)
    dead, live = user_dir / job_dir_name("gone"), user_dir / job_dir_name("running")
    for job in (dead, live):
        job.mkdir(parents=True, mode=0o700)
        (job / "rank-00000.slot0").write_bytes(b"x")
        old = os.stat(job).st_mtime - 3600
        for path in (job / "rank-00000.slot0", job):
            os.utime(path, (old, old))
    user_dir.chmod(0o700)
    squat = root / user_dir_name(uid + 1)
    squat.symlink_to(tmp_path)  # a link claiming another uid's directory: the daemon removes it, and counts it
    node = start_sim_node(tmp_path, gpus=1)
    rank = FakeRank()
    try:
        rank.report(node.daemon.config.runtime_dir, t=node.clock.t, job_id="running", rank=0, step=5,
                    gpu_uuid=node.daemon.monitor.statics[0].uuid)  # fmt: skip
        node.daemon.monitor.tick()
        node.daemon.prune_if_due()
        metrics = node.daemon.renderer.render().decode()
    finally:
        rank.kill()
        rank.wait()
        node.close()
    assert not dead.exists(), "a dead job's slots outlived the grace period"
    assert (live / "rank-00000.slot0").exists(), "a running job's slots were pruned"
    assert not squat.is_symlink() and tmp_path.is_dir()
    assert "gpuwatch_snapshot_dir_squats_removed_total 1.0" in metrics
