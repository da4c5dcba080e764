"""The launcher tells its ranks (and standbys) that it keeps standbys beside them: their snapshots' default
staging budget then leaves a standby's room (gpuwatch.snapshots.budget)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.spares import SparePool
from gpuwatch.trainer.contract import STANDBY_BESIDE_ENV


@pytest.mark.parametrize(("count", "standby", "said"), [(1, True, "1"), (1, False, None), (0, True, None)])
def test_a_rank_learns_whether_a_standby_of_the_job_waits_beside_it(
    tmp_path: Path, count: int, standby: bool, said: str | None
) -> None:
    from gpuwatch.launcher.in_place import InPlacePlan, Supervisor

    pool = SparePool(count, {}, standby=standby)
    supervisor = Supervisor(InPlacePlan("j", ("t.py",), str(tmp_path)), list, echo=print, spares=pool)
    supervisor.node, supervisor.address, supervisor.secret_file = 0, "127.0.0.1:1", str(tmp_path / "secret")
    assert supervisor._rank_env("GPU-0").get(STANDBY_BESIDE_ENV) == said
