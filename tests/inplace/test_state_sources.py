"""The state-source contract, over every implementation: after `sync` in a new group every rank holds the state
of one step, the same on every rank, equal to what an uninterrupted run holds at that step, whether all
ranks held it, or one rank was lost and a new one holds nothing; and the steps after it go on as the
uninterrupted run's. A source that replaces a lost rank from host memory goes back at most K steps.

Each source runs in 2 gloo processes (tests/inplace/contract_worker.py), with no launcher around it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import launch_env

pytestmark = pytest.mark.slow
K = 3
WORLD = 2
LOST_AT = 6


def _run(kind: str, tmp_path: Path) -> list[dict[str, Any]]:
    (tmp_path / "shm").mkdir()
    command = [sys.executable, "-m", "tests.inplace.contract_worker", kind]
    args = [str(WORLD), str(tmp_path / "store"), str(tmp_path / "shm")]
    procs = [
        subprocess.Popen(
            [*command, str(rank), *args], env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for rank in range(WORLD)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize(("kind", "replaced_from"), [("peer", "peer"), ("rollback", "memory"), ("fsdp", "memory")])
def test_every_state_source_brings_every_rank_to_one_step_of_the_uninterrupted_run(
    kind: str, replaced_from: str, tmp_path: Path
) -> None:
    ranks = _run(kind, tmp_path)
    resumed = {r["resumed"] for r in ranks}
    assert len(resumed) == 1, resumed  # one step on every rank
    (step,) = resumed
    assert LOST_AT - K <= step <= LOST_AT, step  # at most K back (replicated state: none)
    if replaced_from == "peer":
        assert step == LOST_AT
    for rank, result in enumerate(ranks):
        fresh, held, after_loss = result["origins"]
        assert held == "held" and fresh == ("peer" if kind == "peer" and rank else "fresh"), result["origins"]
        assert after_loss == (replaced_from if rank == WORLD - 1 else "held" if kind == "peer" else "memory")
        faulted, reference = result["faulted"], result["reference"]
        assert set(faulted) == {str(s) for s in range(9)}, sorted(faulted)
        for at in range(9):  # the held re-formation, the rollback and every step after them: the reference's state
            assert faulted[str(at)] == reference[str(at)], (kind, rank, at)
