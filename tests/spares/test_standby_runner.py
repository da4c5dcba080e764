"""The standby's runner and the pool's choice: a standby runs the job's script up to its join, learns its rank only
at the hand-over, and a hand-over takes the best that is ready (a standby at the join, a warm spare, one starting)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.launcher import in_place
from gpuwatch.launcher.in_place import GpuView, InPlacePlan, Supervisor, _Worker
from gpuwatch.spares.pool import Spare, SparePool
from gpuwatch.trainer.contract import FREEING_ENV
from tests.helpers import launch_env

HELD = ["RANK", "WORLD_SIZE", "GPUWATCH_SPARE_WARM_S"]
GPU = "GPU-standby-test"


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "from gpuwatch.trainer.standby import wait_for_rank\n"
        f"out = open({str(tmp_path / 'out.txt')!r}, 'a')\n" + body
    )
    return script


def _pool(tmp_path: Path, script: Path, lines: list[str]) -> SparePool:
    pool = SparePool(1, launch_env(), standby=True, echo=lines.append)
    # the rank environment of the GPU: RANK is there, but held back until the hand-over
    pool.standby_for([str(script)], lambda gpu: {**launch_env(), "RANK": "9", "WORLD_SIZE": "9"}, HELD)
    pool.start([GPU])
    return pool


def _until(what: str, check: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
def test_a_standby_runs_the_set_up_waits_at_the_join_and_learns_its_rank_at_the_hand_over(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "out.write('set-up done\\n'); out.flush()\n"
        "wait_for_rank()\n"
        "env = os.environ\n"
        "out.write(f\"rank {env['RANK']} of {env['WORLD_SIZE']} waited {env['GPUWATCH_SPARE_WARM_S']}\\n\")\n",
    )
    lines: list[str] = []
    pool = _pool(tmp_path, script, lines)
    try:
        (standby,) = pool.spares
        _until("the standby at the join", lambda: standby.stage() == "standby")
        assert (tmp_path / "out.txt").read_text() == "set-up done\n"  # ran once, waits
        assert standby.any_gpu  # no CUDA context made: it may take a rank of any GPU
        env = {**launch_env(), "RANK": "3", "WORLD_SIZE": "4"}
        assert pool.hand_over([str(script)], env, "GPU-other") is standby
        assert standby.process.wait(timeout=30) == 0
        said = (tmp_path / "out.txt").read_text().splitlines()
        assert said[0] == "set-up done" and said[1].startswith("rank 3 of 4 waited "), said
        pool.tick()  # the launcher's loop: the rank ended, so the spare owed behind it starts
        assert len(pool.spares) == 1 and pool.spares[0] is not standby  # another behind it
    finally:
        pool.close()
    assert not lines, lines


@pytest.mark.slow
def test_a_script_that_reads_rank_before_the_join_waits_there_and_says_where(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "rank = os.environ.get('RANK')\nout.write(f'rank {rank}\\n')\nwait_for_rank()\n")
    pool = _pool(tmp_path, script, [])
    try:
        (standby,) = pool.spares
        _until("the standby waits", lambda: standby.stage() == "standby")
        assert not (tmp_path / "out.txt").read_text()  # the read waits for the hand-over
        pool.hand_over([str(script)], {**launch_env(), "RANK": "2"}, GPU)
        assert standby.process.wait(timeout=30) == 0
        assert (tmp_path / "out.txt").read_text() == "rank 2\n"
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert f"the job reads RANK before it joins the job ({script}:4)" in err, err


@pytest.mark.slow
def test_what_the_job_side_prepares_for_the_join_runs_before_the_standby_waits_and_a_failure_only_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The standby waits at a RANK read here (as at `TrainerLink()` before the job object): the prepares run there."""
    script = _script(
        tmp_path,
        "from gpuwatch.trainer.standby import before_waiting\n"
        "def broken():\n    raise OSError('no pinned memory')\n"
        "before_waiting(broken)\n"
        "before_waiting(lambda: (out.write('prepared\\n'), out.flush()))\n"
        "rank = os.environ['RANK']\n"
        "out.write(f'rank {rank}\\n')\n",
    )
    pool = _pool(tmp_path, script, [])
    try:
        (standby,) = pool.spares
        _until("the standby waits", lambda: standby.stage() == "standby")
        assert (tmp_path / "out.txt").read_text() == "prepared\n"  # before it said it was ready
        pool.hand_over([str(script)], {**launch_env(), "RANK": "2"}, GPU)
        assert standby.process.wait(timeout=30) == 0
        assert (tmp_path / "out.txt").read_text() == "prepared\nrank 2\n"
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert "gpuwatch standby: broken before the join failed: OSError: no pinned memory" in err, err


@pytest.mark.slow
def test_a_standby_that_ends_before_the_join_turns_standby_off_in_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path, "sys.exit(3)\n")
    lines: list[str] = []
    pool = _pool(tmp_path, script, lines)
    try:
        (standby,) = pool.spares
        standby.process.wait(timeout=60)
        replacement = pool.hand_over([sys.executable, "-c", "pass"], launch_env(), GPU)
        assert replacement is not None and not replacement.standby
        assert len(lines) == 1 and "ended before the job's join (exit 3)" in lines[0], lines
        replacement.process.wait(timeout=60)
        pool.tick()  # the rank ended: the spare owed behind it starts
        assert not pool.spares[0].standby
    finally:
        pool.close()


def _fake(said: bytes, started: float, *, standby: bool = True) -> Spare:
    process = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, said)
    os.close(write_fd)
    word_fd, say_fd = os.pipe()
    os.close(say_fd)
    return Spare(process, read_fd, word_fd, GPU, started, standby=standby)


def test_a_hand_over_takes_the_standby_at_the_join_then_a_warm_spare_then_one_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = SparePool(3, {}, echo=lambda _: None)
    monkeypatch.setattr(pool, "_spawn", lambda *_args, **_kw: None)
    starting, warm, standby = _fake(b"", 1.0), _fake(b"1", 2.0), _fake(b"1j", 3.0)  # the oldest first
    pool.spares = [starting, warm, standby]
    try:
        order = [pool.hand_over(["job.py"], {}, GPU) for _ in range(3)]
        assert order == [standby, warm, starting]
        assert [s.stage() for s in order] == ["standby", "warm", "starting"]
    finally:
        for spare in (starting, warm, standby):
            spare.process.kill()
            spare.process.wait()
            spare.close()


def test_where_the_gpu_has_no_room_beside_its_rank_the_spare_is_no_standby_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lines: list[str] = []
    pool = SparePool(1, {}, standby=True, echo=lines.append)
    supervisor = Supervisor(InPlacePlan("job", ("train.py",), str(tmp_path)), list, echo=lines.append, spares=pool)
    supervisor.node, supervisor.address, supervisor.secret_file = 0, "127.0.0.1:1", str(tmp_path / "secret")
    rank = subprocess.Popen(["sleep", "30"])
    supervisor.workers = [_Worker("n0.g0.0", 0, GPU, rank)]  # type: ignore[arg-type]
    pool.standby_for(["train.py"], supervisor._standby_env, HELD)
    try:
        monkeypatch.setattr(pool, "room_for", lambda gpu, pid: pid != rank.pid)  # NVML: not beside that rank
        assert pool._standby_env(GPU) is None
        assert lines == [
            "gpuwatch launch: in place: GPU 0: no room beside the rank for a standby of the job:"
            " a spare waits there without the job's set-up"
        ]
        monkeypatch.setattr(pool, "room_for", lambda gpu, pid: True)
        env = pool._standby_env(GPU)
        assert env is not None and env["CUDA_VISIBLE_DEVICES"] == GPU and env["GPUWATCH_SPARE_ARGV"] == '["train.py"]'
        assert not {"RANK", "WORLD_SIZE", "GPUWATCH_INPLACE_MEMBER"} & set(env)
    finally:
        rank.kill()
        rank.wait()


def test_the_spare_behind_a_rank_handed_over_waits_until_the_rank_it_replaced_has_freed_its_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A room check beside the new rank while the old one still frees its memory finds none (an H100 at 16 GiB:
    the next spare then waited without the job's set-up): the standby behind starts once the GPU is freed."""
    pool = SparePool(1, {}, standby=True, echo=lambda _: None)
    freeing = {GPU}
    pool.standby_for(["train.py"], lambda gpu: {}, HELD, freeing.__contains__)
    spawned: list[str | None] = []
    monkeypatch.setattr(pool, "_spawn", lambda gpu, **_kw: spawned.append(gpu))
    rank = _fake(b"1js", 1.0)  # a standby that became the rank and finished its first step
    pool._behind.append((rank, GPU, time.monotonic()))
    try:
        pool.tick()
        assert spawned == [] and rank.has_stepped()  # stepped, but the replaced rank still holds its memory
        freeing.clear()  # reaped: its memory is freed
        pool.tick()
        pool.tick()
        assert spawned == [GPU]  # once
    finally:
        rank.process.kill()
        rank.process.wait()
        rank.close()


class _Handed(Exception):
    """Raised by a hand-over that only records the environment it was given."""


@pytest.mark.parametrize(("dying", "held", "expected"), [(4242, 30 << 30, f"4242:{30 << 30}"), (4242, 0, None)])
def test_a_replacement_beside_a_rank_still_exiting_is_told_what_that_rank_holds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dying: int, held: int, expected: str | None
) -> None:
    """Its snapshot staging counts that memory as free while the process exits (gpuwatch.snapshots.budget);
    where NVML cannot say what it holds (0), the rank is told nothing."""
    pool = SparePool(1, {}, standby=True, echo=lambda _: None)
    supervisor = Supervisor(InPlacePlan("job", ("train.py",), str(tmp_path)), list, echo=lambda _: None, spares=pool)
    supervisor.node, supervisor.address, supervisor.secret_file = 0, "127.0.0.1:1", str(tmp_path / "secret")
    supervisor._dying[GPU] = dying
    monkeypatch.setattr(in_place, "held_by", lambda uuid, pid: held if (uuid, pid) == (GPU, dying) else 0)
    given: list[dict[str, str]] = []

    def hand_over(_argv: object, env: dict[str, str], _gpu: str) -> None:
        given.append(env)
        raise _Handed

    monkeypatch.setattr(pool, "hand_over", hand_over)
    with pytest.raises(_Handed):
        supervisor._start(GpuView(0, GPU, True, 0), replacement=True)
    assert given[0].get(FREEING_ENV) == expected
    supervisor._dying.clear()  # the predecessor reaped: its memory is free, nothing to tell
    with pytest.raises(_Handed):
        supervisor._start(GpuView(0, GPU, True, 0), replacement=True)
    assert FREEING_ENV not in given[1]


@pytest.mark.slow
def test_the_spare_behind_a_standby_handed_over_starts_only_once_its_rank_stepped(tmp_path: Path) -> None:
    """While the new rank restores its state, no standby's set-up competes with it for CPU and memory: the next
    one starts when the rank says its first step (the step engine calls first_step_done after each step)."""
    go = tmp_path / "go"
    script = _script(
        tmp_path,
        "import time\n"
        "from gpuwatch.trainer.standby import first_step_done\n"
        "wait_for_rank()\n"
        f"while not os.path.exists({str(go)!r}):  # the rank restores its state\n"
        "    time.sleep(0.01)\n"
        "first_step_done()\n"
        "first_step_done()  # said once\n"
        "time.sleep(60)\n",
    )
    lines: list[str] = []
    pool = _pool(tmp_path, script, lines)
    try:
        (standby,) = pool.spares
        _until("the standby at the join", lambda: standby.stage() == "standby")
        assert pool.hand_over([str(script)], launch_env(), GPU) is standby
        for _ in range(20):  # two seconds of the launcher's ticks while the rank has not stepped
            pool.tick()
            assert pool.spares == [] and not standby.has_stepped()
            time.sleep(0.1)
        go.touch()

        def started() -> bool:
            pool.tick()
            return bool(pool.spares)

        _until("a standby started behind the rank that stepped", started)
        assert standby.has_stepped() and standby.process.poll() is None and len(pool.spares) == 1
        standby.process.kill()
        standby.process.wait()
        standby.close()
    finally:
        pool.close()
    assert not lines, lines
