"""The default staging budget: with standbys of the job beside the rank it leaves a standby's room on the GPU.

The GPU's memory is faked (this machine has none): `staging_budget` and `allocate_staging` are given the
free memory and a torch whose `empty` hands out sized placeholders.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.snapshots import prepare
from gpuwatch.snapshots.budget import staging_budget
from gpuwatch.snapshots.layout import open_job_dir
from gpuwatch.trainer.contract import FREEING_ENV, STANDBY_BESIDE_ENV
from tests.snapshots.conftest import GIB, free_gib

STANDBY = {STANDBY_BESIDE_ENV: "1"}


def test_with_standbys_the_budget_leaves_free_what_the_rank_then_holds_plus_the_headroom() -> None:
    # The 16 GiB job on an 80 GiB GPU: 24 GiB in use after the rank's first step, 56 GiB free; the headroom
    # is 4 GiB (5 % of 80). Staging may take (56 - 4 - 24) / 2 = 14 GiB: then 42 GiB stay free, the rank
    # holds 38 GiB, and the launcher's check for a standby (free >= held) passes with the 4 GiB to spare.
    budget = staging_budget(None, 0, environ=STANDBY, free_bytes=free_gib(56))
    assert budget.limit == 14 * GIB
    assert budget.why == "leaves a standby's room: (56.00 GiB free - 4.00 GiB headroom - 24.00 GiB in use) / 2"
    free_after, held_after = 56 * GIB - budget.limit, 24 * GIB + budget.limit
    assert free_after - held_after == 4 * GIB


def test_the_headroom_is_2_gib_on_a_small_gpu() -> None:
    assert staging_budget(None, 0, environ=STANDBY, free_bytes=free_gib(30, 40)).limit == 9 * GIB  # (30 - 2 - 10) / 2


def test_no_room_left_is_a_budget_of_zero_not_a_negative_one() -> None:
    assert staging_budget(None, 0, environ=STANDBY, free_bytes=free_gib(30)).limit == 0  # (30 - 4 - 50) < 0


def test_the_memory_a_replaced_rank_still_frees_counts_as_free_while_its_process_exits() -> None:
    # A 16 GiB rank's first step on a 140 GiB GPU, its predecessor still exiting with 40 GiB: 52 GiB free,
    # 88 GiB in use. Counted in use, that left no staging ((52 - 7 - 88) / 2 < 0: every snapshot direct);
    # counted free, (52 + 40 - 7 - 48) / 2 = 18.5 GiB, and the standby's room holds once it is freed.
    exiting = {**STANDBY, FREEING_ENV: f"{os.getpid()}:{40 * GIB}"}
    budget = staging_budget(None, 0, environ=exiting, free_bytes=free_gib(52, 140))
    assert budget.limit == int(18.5 * GIB)
    assert budget.why == (
        "leaves a standby's room: (52.00 GiB free + 40.00 GiB the replaced rank frees - 7.00 GiB headroom"
        " - 48.00 GiB in use) / 2"
    )
    free_after, held_after = (52 + 40) * GIB - budget.limit, 48 * GIB + budget.limit
    assert free_after - held_after == 7 * GIB
    assert staging_budget(None, 0, environ=STANDBY, free_bytes=free_gib(52, 140)).limit == 0


def test_a_replaced_rank_that_is_gone_or_a_bad_value_frees_nothing_more() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its memory is free already, and counted so by the GPU
    for value in (f"{gone.pid}:{40 * GIB}", "x:1", f"{os.getpid()}:-5", f"{os.getpid()}", ""):
        budget = staging_budget(None, 0, environ={**STANDBY, FREEING_ENV: value}, free_bytes=free_gib(56))
        assert budget.limit == 14 * GIB, value  # as without it: (56 - 4 - 24) / 2
    # never more than what is in use (24 GiB here): (56 + 24 - 4 - 0) / 2
    huge = {**STANDBY, FREEING_ENV: f"{os.getpid()}:{1000 * GIB}"}
    assert staging_budget(None, 0, environ=huge, free_bytes=free_gib(56)).limit == 38 * GIB


def test_without_standbys_and_with_a_given_budget_nothing_is_measured() -> None:
    def never(*_: Any) -> Any:
        raise AssertionError("measured")

    assert staging_budget(None, 0, environ={}, free_bytes=never).limit is None
    given = staging_budget(3 * GIB, 0, environ=STANDBY, free_bytes=never)
    assert given.limit == 3 * GIB and given.why == "gpu_budget given"


def _prepare(tmp_path: Path, nbytes: int, budget: int | None = None) -> prepare.Prepared:
    dir_fd = open_job_dir(str(tmp_path), "budget")
    try:
        prepared = prepare.Preparation(dir_fd, 0, nbytes, cuda=0, staging=True, replace=set(), budget=budget).join()
    finally:
        os.close(dir_fd)
    for slot in prepared.slots.values():
        slot.close()
    assert prepared.error is None, prepared.error
    return prepared


def test_under_a_launcher_with_standbys_staging_takes_only_what_is_left_beyond_the_standbys_room(
    tmp_path: Path, fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STANDBY_BESIDE_ENV, "1")
    prepared = _prepare(tmp_path, 64 << 20)  # a small state for the slots in tmp_path; the GPU is faked
    assert prepared.budget is not None and prepared.budget.limit == 14 * GIB  # (56 - 4 - 24) / 2
    assert prepared.mode == "staged" and fake_gpu == [64 << 20]
    fake_gpu.clear()
    # the state of the job: 16 GiB staged in part, what the standby's room leaves
    staging = prepare.allocate_staging(16 * GIB, 0, budget=prepared.budget.limit)
    assert fake_gpu == [14 * GIB] and prepare.mode_of(16 * GIB, staging) == "partial"


def test_without_standbys_staging_takes_what_is_free_less_the_headroom(
    tmp_path: Path, fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STANDBY_BESIDE_ENV, raising=False)
    prepared = _prepare(tmp_path, 1 << 20)
    assert prepared.budget is not None and prepared.budget.limit is None
    staging = prepare.allocate_staging(60 * GIB, 0, budget=prepared.budget.limit)
    assert fake_gpu == [52 * GIB] and prepare.mode_of(60 * GIB, staging) == "partial"  # 56 - 4


def test_a_given_budget_wins_over_the_standbys_room(
    tmp_path: Path, fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STANDBY_BESIDE_ENV, "1")
    prepared = _prepare(tmp_path, 1 << 20, budget=40 * GIB)
    assert prepared.budget is not None and prepared.budget.limit == 40 * GIB
    assert prepared.budget.why == "gpu_budget given"


def test_a_gpu_with_no_room_beside_the_standby_drains_directly(
    tmp_path: Path, fake_gpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STANDBY_BESIDE_ENV, "1")
    monkeypatch.setattr(sys.modules["torch"].cuda, "mem_get_info", free_gib(30))  # 50 GiB in use: (30 - 4 - 50) < 0
    prepared = _prepare(tmp_path, 1 << 20)
    assert prepared.budget is not None and prepared.budget.limit == 0
    assert prepared.mode == "direct" and prepared.staging is None and fake_gpu == []
