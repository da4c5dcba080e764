"""SparePool and the spare process: a warm spare becomes the rank it is handed (its argv, its environment,
its exit code), a new spare starts behind it, and the spares left end with the pool; bad input is refused."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatch.launcher.launch import launch
from gpuwatch.spares import SparePool
from tests.helpers import launch_env

JOB = """import json, os, sys
with open(sys.argv[1], "w") as out:
    json.dump({"argv": sys.argv, "rank": os.environ.get("RANK"), "warm": os.environ.get("GPUWATCH_SPARE_WARM_S"),
               "stdin": sys.stdin.read(), "main": __name__}, out)
sys.exit(3)
"""


def _until_warm(pool: SparePool) -> None:
    deadline = time.monotonic() + 120
    while not pool.warm():
        assert time.monotonic() < deadline, "the spare did not get warm"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_spare_runs_the_rank_it_is_handed_and_another_starts_behind_it(tmp_path: Path) -> None:
    script, result = tmp_path / "job.py", tmp_path / "result.json"
    script.write_text(JOB)
    pool = SparePool(1, launch_env(), echo=lambda _: None)
    pool.start(["GPU-0"])
    try:
        _until_warm(pool)
        first = pool.spares[0].process.pid
        assert pool.describe() == f"pid {first} (warm, any GPU)"  # what the launch log says a hand-over chose among
        rss = pool.spares[0].rss_bytes()
        assert rss is not None and rss > 50 << 20  # torch is imported
        spare = pool.hand_over([str(script), str(result), "x"], {**launch_env(), "RANK": "2"}, "GPU-0")
        assert spare is not None and spare.process.pid == first
        assert spare.process.wait(timeout=60) == 3  # the job's exit is the rank's
        assert spare.last_word() == 3  # said before its exit began
        spare.close()
        seen = json.loads(result.read_text())
        assert seen["argv"] == [str(script), str(result), "x"] and seen["rank"] == "2", seen
        assert seen["main"] == "__main__" and seen["stdin"] == "" and float(seen["warm"]) >= 0, seen
        pool.tick()  # the launcher's loop: the rank ended, so the spare owed behind it starts
        assert len(pool.spares) == 1 and pool.spares[0].process.pid != first  # the next one is starting
    finally:
        pool.close()
    assert pool.spares == [] and pool.handed_over == 1 and pool.describe() == "none"


def test_a_pool_of_none_hands_over_nothing_and_a_negative_count_is_refused() -> None:
    assert SparePool(0, os.environ).hand_over([sys.executable], {}, "GPU-0") is None
    with pytest.raises(ValueError, match="must not be negative"):
        SparePool(-1, os.environ)


def test_spares_without_in_place_is_one_line_and_exit_2_saying_why(tmp_path: Path) -> None:
    result = CliRunner().invoke(launch, ["--spares", "1", "--state-dir", str(tmp_path), "--", "train.py"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr == (
        "gpuwatch launch: error: --spares needs --in-place: torchrun starts each worker itself as a new interpreter"
        " and stops every worker when one fails, so there is no rank to hand to a warm spare\n"
    )


def test_the_nodes_trainer_spares_leaves_a_torchrun_launch_alone(tmp_path: Path) -> None:
    """trainer.spares is the default of in-place launches: a node that sets it still runs torchrun jobs
    (no daemon here: the launch gets past the flag checks and stops at the daemon, not at the spares)."""
    config = tmp_path / "gpuwatch.toml"
    config.write_text(f'state_dir = "{tmp_path}"\nlisten = "127.0.0.1:1"\n\n[trainer]\nspares = 2\n')
    result = CliRunner().invoke(launch, ["--config", str(config), "--", "train.py"])
    assert result.exit_code != 0 and "--spares" not in result.stderr, result.stderr
    assert result.stderr.startswith("gpuwatch launch: error: ") and "daemon" in result.stderr, result.stderr


def test_a_replacement_due_on_a_gpu_no_longer_usable_moves_to_a_free_usable_gpu_with_its_rank(tmp_path: Path) -> None:
    from gpuwatch.launcher.in_place import GpuView, InPlacePlan, Supervisor

    views = [GpuView(0, "GPU-0", False, 1), GpuView(1, "GPU-1", True, 0)]  # GPU 0 quarantined since its rank died
    said: list[str] = []
    supervisor = Supervisor(InPlacePlan("j", ("t.py",), str(tmp_path)), lambda: views, echo=said.append,
                            spares=SparePool(0, {}))  # fmt: skip
    supervisor.gpus.replace_at["GPU-0"] = 0.0
    supervisor.gpus.rank_of["GPU-0"] = (1, 3)
    supervisor.gpus.used.add("GPU-0")
    started: list[tuple[str, int, int, bool]] = []
    supervisor._start = lambda gpu, rank=0, world=1, replacement=False: started.append(  # type: ignore[method-assign]
        (gpu.uuid, rank, world, replacement)
    )
    supervisor._grow()
    assert started == [("GPU-1", 1, 3, True)], (started, said)
    assert "GPU-0 is not usable: its rank moves to GPU-1" in said[0], said


LOOP = """import time
while True:
    time.sleep(0.01)
"""


def test_a_killed_rank_leaves_no_last_word_and_its_exit_is_seen_before_it_is_reaped(tmp_path: Path) -> None:
    """The launcher replaces a rank when its exit begins: no word from the runner means it was killed."""
    from gpuwatch.launcher.in_place import exit_began

    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    pool = SparePool(0, launch_env(), echo=lambda _: None)
    rank = pool.run_now([str(script)], launch_env())
    assert rank is not None
    try:
        time.sleep(0.5)
        assert exit_began(rank.process.pid) is False and rank.last_word() is None
        os.kill(rank.process.pid, 9)
        deadline = time.monotonic() + 10
        while not exit_began(rank.process.pid):  # a zombie not yet reaped: its exit has begun
            assert time.monotonic() < deadline, "the killed rank's exit was never seen"
            time.sleep(0.01)
        assert rank.last_word() is None  # killed: the job never said how it ended
        assert rank.process.wait(timeout=10) == -9
        assert exit_began(rank.process.pid) is None  # reaped: gone
    finally:
        rank.close()


@pytest.mark.parametrize(
    ("ending", "code"), [("sys.exit(75)", 75), ("os._exit(0)", 0), ("raise RuntimeError('x')", 1), ("pass", 0)]
)
def test_a_job_that_ends_by_itself_says_its_exit_code_first(tmp_path: Path, ending: str, code: int) -> None:
    script = tmp_path / "end.py"
    script.write_text(f"import os, sys\n{ending}\n")
    rank = SparePool(0, launch_env(), echo=lambda _: None).run_now([str(script)], launch_env())
    assert rank is not None
    try:
        assert rank.process.wait(timeout=60) == code
        assert rank.last_word() == code
    finally:
        rank.close()


class _FakeNvml:
    """pynvml's calls room_beside makes, for one GPU: `free` bytes free of `total`, `pids` holding memory."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):  # noqa: N801  (pynvml's name)
        pass

    def __init__(self, total: int, free: int, pids: dict[int, int]) -> None:
        self.total, self.free, self.pids = total, free, pids

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802
        if uuid != "GPU-a":
            raise self.NVMLError_NotFound()
        return uuid

    def nvmlDeviceGetMemoryInfo(self, _handle: str) -> Any:  # noqa: N802
        return SimpleNamespace(total=self.total, free=self.free)

    def nvmlDeviceGetComputeRunningProcesses(self, _handle: str) -> list[Any]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.pids.items()]


@pytest.mark.parametrize(
    ("free", "pids", "room"),
    [
        (100, {7: 30}, True),  # room for as much again as the dying rank holds
        (20, {7: 30}, False),  # a job using most of its GPU: wait until the dead rank's memory is freed
        (60, {}, True),  # the dying pid not listed (another PID namespace): bounded by all in use (40)
        (30, {}, False),
        (20, {7: 30, 9: 12}, True),  # the standby (pid 9) that takes the rank already holds 12 of the 30
        (20, {7: 30, 9: 8}, False),
    ],
)
def test_a_replacement_starts_beside_a_dying_rank_only_where_the_gpu_has_room(
    monkeypatch: pytest.MonkeyPatch, free: int, pids: dict[int, int], room: bool
) -> None:
    from gpuwatch.spares import room as room_module

    monkeypatch.setattr(room_module, "_nvml", [_FakeNvml(100, free, pids)])
    assert room_module.room_beside("GPU-a", 7, taker=9) is room
    assert room_module.room_beside("GPU-bench-cpu-0", 7) is True  # no GPU NVML knows: no memory to wait for


@pytest.mark.parametrize(("pids", "held"), [({7: 30, 9: 12}, 30), ({9: 12}, 0), ({7: None}, 0)])
def test_what_a_dying_rank_holds_is_nvmls_figure_for_its_pid_or_nothing(
    monkeypatch: pytest.MonkeyPatch, pids: dict[int, Any], held: int
) -> None:
    from gpuwatch.spares import room as room_module

    monkeypatch.setattr(room_module, "_nvml", [_FakeNvml(100, 20, pids)])
    assert room_module.held_by("GPU-a", 7) == held  # not listed (another PID namespace) or not said: 0
    assert room_module.held_by("GPU-bench-cpu-0", 7) == 0  # a GPU NVML does not know


def test_a_first_rank_run_by_the_runner_is_no_spare(tmp_path: Path) -> None:
    """run_now starts a job's first ranks under the runner: same __main__ and exit, but its report must not
    say a spare took it over (GPUWATCH_SPARE_WARM_S is a spare's alone)."""
    script, result = tmp_path / "job.py", tmp_path / "result.json"
    script.write_text(JOB)
    rank = SparePool(0, launch_env(), echo=lambda _: None).run_now([str(script), str(result)], launch_env())
    assert rank is not None
    try:
        assert rank.process.wait(timeout=60) == 3 and rank.last_word() == 3
    finally:
        rank.close()
    seen = json.loads(result.read_text())
    assert seen["main"] == "__main__" and seen["warm"] is None, seen


@pytest.mark.slow
def test_a_spare_that_cannot_take_its_order_is_said_and_the_next_one_takes_the_rank(tmp_path: Path) -> None:
    script, result = tmp_path / "job.py", tmp_path / "result.json"
    script.write_text(JOB)
    said: list[str] = []
    pool = SparePool(1, launch_env(), echo=said.append)
    pool.start(["GPU-0"])
    try:
        _until_warm(pool)
        gone = pool.spares[0].process
        assert gone.stdin is not None
        gone.stdin.close()  # the order cannot be written: as to a spare that died as it was chosen
        spare = pool.hand_over([str(script), str(result)], {**launch_env(), "RANK": "1"}, "GPU-0")
        assert spare is not None and spare.process.pid != gone.pid
        assert spare.process.wait(timeout=120) == 3 and json.loads(result.read_text())["rank"] == "1"
        spare.close()
    finally:
        pool.close()
    (line,) = [s for s in said if "could not take the rank" in s]
    assert f"pid {gone.pid}, warm) could not take the rank: its input was closed" in line, line
