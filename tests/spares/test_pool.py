"""SparePool and the spare process: a warm spare becomes the rank it is handed (its argv, its environment,
its exit code), a new spare starts behind it, and the spares left end with the pool; bad input is refused."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

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


def test_a_spare_runs_the_rank_it_is_handed_and_another_starts_behind_it(tmp_path: Path) -> None:
    script, result = tmp_path / "job.py", tmp_path / "result.json"
    script.write_text(JOB)
    pool = SparePool(1, launch_env(), echo=lambda _: None)
    pool.start(["GPU-0"])
    try:
        deadline = time.monotonic() + 120
        while not pool.warm():
            assert time.monotonic() < deadline, "the spare did not get warm"
            time.sleep(0.05)
        first = pool.spares[0].process.pid
        rss = pool.spares[0].rss_bytes()
        assert rss is not None and rss > 50 << 20  # torch is imported
        process = pool.hand_over([str(script), str(result), "x"], {**launch_env(), "RANK": "2"}, "GPU-0")
        assert process is not None and process.pid == first
        assert process.wait(timeout=60) == 3  # the job's exit is the rank's
        seen = json.loads(result.read_text())
        assert seen["argv"] == [str(script), str(result), "x"] and seen["rank"] == "2", seen
        assert seen["main"] == "__main__" and seen["stdin"] == "" and float(seen["warm"]) >= 0, seen
        assert len(pool.spares) == 1 and pool.spares[0].process.pid != first  # the next one is starting
    finally:
        pool.close()
    assert pool.spares == [] and pool.handed_over == 1


def test_a_pool_of_none_hands_over_nothing_and_a_negative_count_is_refused() -> None:
    assert SparePool(0, os.environ).hand_over([sys.executable], {}, "GPU-0") is None
    with pytest.raises(ValueError, match="must not be negative"):
        SparePool(-1, os.environ)


def test_spares_without_in_place_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(launch, ["--spares", "1", "--state-dir", str(tmp_path), "--", "train.py"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr == (
        "gpuwatch launch: error: --spares (trainer.spares) needs --in-place: torchrun starts its own workers\n"
    )


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
