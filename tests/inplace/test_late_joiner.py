"""A replacement that starts while the survivors finish must never hold the job open.

The shipped 3-rank example under `gpuwatch launch --in-place` (sim daemon, CPU), rank 1 SIGKILLed
15 steps before the end: the survivors finish meanwhile, and the replacement the launcher starts a
second after the death comes up after them (on a slow machine it may still join in time, and then
finishes with them). It must end (exit 0) rather than wait for a generation
that never comes, so the launcher exits 0 within 60 s of the survivors' last step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.inplace.jobs import assert_no_step_lost_or_repeated, launch_in_place, sim_node

pytestmark = pytest.mark.slow
STEPS, KILL_AT = 80, 65
EXIT_WITHIN_S = 60.0


def test_a_replacement_starting_as_the_survivors_finish_ends_and_the_launch_exits_0(tmp_path: Path) -> None:
    with sim_node(tmp_path / "node", gpus=3) as node:
        run = launch_in_place(node, tmp_path, STEPS, step_sleep=0.1)
        run.wait_for(f"3 ranks at step {KILL_AT}", lambda lines: len(run.ranks_at(KILL_AT, 3)) == 3)
        pids = {r["gpu"]: r["pid"] for r in node.get("/v1/trainers")["ranks"]}
        os.kill(pids[1], signal.SIGKILL)
        survivors = [pids[0], pids[2]]

        deadline = time.monotonic() + 90
        while not set(survivors) <= {ln["pid"] for ln in run.steps() if ln["step"] == STEPS}:
            assert time.monotonic() < deadline, f"the survivors did not finish: {run.output(0.1)}"
            time.sleep(0.05)
        last = max(ln["t"] for ln in run.steps() if ln["pid"] in survivors)
        try:
            code: int | None = run.process.wait(timeout=max(1.0, EXIT_WITHIN_S - (time.time() - last)))
        except subprocess.TimeoutExpired:
            code = None
        exited = time.time()
        _, stderr = run.output()

    assert code == 0 and exited - last <= EXIT_WITHIN_S, (code, exited - last, stderr)
    assert "replacement 1/3: a rank joins" in stderr, stderr  # the late replacement did start
    lines = run.steps()
    assert_no_step_lost_or_repeated(lines, survivors)
    finished = {ln["pid"] for ln in lines if ln["step"] == STEPS}
    assert set(survivors) <= finished and len(finished) <= 3, finished
    how = "late" if finished == set(survivors) else "in time, and finished with them"
    print(f"\nreplacement {how}: launch exited {code} {exited - last:.1f} s after the survivors' last step")
