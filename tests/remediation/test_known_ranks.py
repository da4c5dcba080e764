"""What the remediation thread knows of a rank between publishes: a rank that dies keeps what its reports said.

Seen on an H100 with a one-rank in-place job and a standby: NVML listed the killed rank for a second more, its
report was gone and /proc gave no start time, and the publish made it a rank known from its environment alone
(no `recovery`). Its death was then taken for a relaunch job's, and the daemon sent the stop signal to the standby
that had just taken its place.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.config import Config
from gpuwatch.model import GpuSample, GpuStatic, GpuStatus, Snapshot, TrainerInfo
from gpuwatch.node.ranks import Rank
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.node.store import Store
from gpuwatch.remediation.service import Remediation, _Publish
from gpuwatch.reports.board import Report
from gpuwatch.trainer.contract import RECOVERY_IN_PLACE

UUID = "GPU-0000"


@pytest.fixture
def remediation(tmp_path: Path) -> Iterator[Remediation]:
    (tmp_path / "run").mkdir()
    store, runtime = Store(tmp_path / "gpuwatch.db"), RuntimeDir(tmp_path / "run")
    service = Remediation(Config(), store, runtime)
    service.close()  # its thread gone, the test hands it each publish and exit itself
    yield service
    runtime.close()
    store.close()


def _process() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _publish(*ranks: Rank) -> _Publish:
    gpu = GpuStatus(static=GpuStatic(index=0, uuid=UUID), sample=GpuSample(t=0.0, index=0, uuid=UUID))
    return _Publish(Snapshot(t=0.0, backend="nvml", gpus=(gpu,)), ranks, (), ())


def _rank(pid: int, *, reported: bool) -> Rank:
    """As map_ranks makes it: from its report, or (a process exiting) from NVML and its environment alone, when
    /proc no longer gives its start time either."""
    info = TrainerInfo(pid=pid, rank=0, world_size=1, job_id="job", gpu_uuid=UUID, step=130, updated_t=1.0)
    if reported:
        info = dataclasses.replace(info, recovery=RECOVERY_IN_PLACE)
    sources = ("report", "environ", "nvml") if reported else ("environ", "nvml")
    return Rank(info, 0, os.getuid(), ProcFs().start_time(pid) if reported else None, sources)


def test_a_rank_nvml_still_lists_after_its_report_is_gone_keeps_its_recovery_and_its_successor_is_not_stopped(
    remediation: Remediation,
) -> None:
    killed, standby = _process(), _process()
    try:
        remediation._handle_publish(_publish(_rank(killed.pid, reported=True), _rank(standby.pid, reported=True)))
        killed.kill()
        killed.wait()
        last_word = Report(_rank(killed.pid, reported=True).info, os.getuid(), alive=False)  # ended: None (killed)
        remediation.runtime.read_report = lambda pid: last_word if pid == killed.pid else None  # type: ignore[method-assign]
        remediation._handle_publish(_publish(_rank(killed.pid, reported=False), _rank(standby.pid, reported=True)))
        assert remediation._known[killed.pid].in_place  # its last report stands

        remediation._on_exit(killed.pid)

        total, incident = remediation.incidents.latest()
        assert total == 1 and incident is not None
        assert (incident["kind"], incident["path"]) == ("rank_died", "in_place")
        assert [t.rank.pid for stop in remediation._stops for t in stop.incident.targets] == []  # the standby goes on
    finally:
        for process in (killed, standby):
            process.kill()
            process.wait()


def test_a_dead_ranks_own_last_report_says_how_its_job_recovers_whatever_the_publishes_knew(
    remediation: Remediation,
) -> None:
    """A rank the publishes only ever knew from NVML and its environment (its reports went stale in between): its
    last report, read at its death, still makes its in-place job's death an in-place one."""
    killed, standby = _process(), _process()
    try:
        remediation._handle_publish(_publish(_rank(killed.pid, reported=False), _rank(standby.pid, reported=True)))
        killed.kill()
        killed.wait()
        last_word = Report(_rank(killed.pid, reported=True).info, os.getuid(), alive=False)
        remediation.runtime.read_report = lambda pid: last_word if pid == killed.pid else None  # type: ignore[method-assign]

        remediation._on_exit(killed.pid)

        _, incident = remediation.incidents.latest()
        assert incident is not None and incident["path"] == "in_place"
        assert remediation._stops == []  # the standby goes on
    finally:
        for process in (killed, standby):
            process.kill()
            process.wait()


def test_a_death_seen_after_the_standby_has_redone_its_steps_counts_from_the_standbys_first_step(
    remediation: Remediation,
) -> None:
    """Seen on an H100 at 16 GiB: the killed rank's exit took 2.4 s (the driver freed its memory), and the daemon
    read the standby's report one step past the 8 it redid: the incident said 2.31 s and 0 steps lost against the
    loop's 1.52 s and 8. The standby's own first step after the fault is exact, however late it is read."""
    killed, standby = _process(), _process()
    try:  # the publish before the death was read lists both: the dying rank (NVML) and the standby, rank 0 now
        remediation._handle_publish(_publish(_rank(killed.pid, reported=True), _rank(standby.pid, reported=True)))
        killed.kill()
        killed.wait()
        last_word = Report(_rank(killed.pid, reported=True).info, os.getuid(), alive=False)  # its last step: 130
        remediation.runtime.read_report = lambda pid: last_word if pid == killed.pid else None  # type: ignore[method-assign]
        remediation._on_exit(killed.pid)
        (incident,) = remediation._watches.incidents()
        assert incident.path == "in_place"  # the job still has a rank: the standby that took the place
        began = incident.began
        info = dataclasses.replace(
            _rank(standby.pid, reported=True).info, step=131, step_t=began + 2.31, first_step=123,
            first_step_t=began + 1.52, spare=True, spare_stage="standby",
        )  # fmt: skip
        remediation._watches.check([Report(info, os.getuid(), alive=True)])
        assert (incident.status, incident.path) == ("resumed", "spare")
        assert (incident.time_to_resume_s, incident.resumed_step, incident.steps_lost) == (1.52, 122, 8)
    finally:
        for process in (killed, standby):
            process.kill()
            process.wait()
