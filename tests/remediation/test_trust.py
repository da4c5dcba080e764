"""A fault acts once, on the jobs it can have hurt, and every incident's figures are what happened.

Each case was seen on an H200 as a new user would meet it: a daemon restart that replayed an old
application XID stopped a healthy job; another process's XID stopped every job on its GPU; a kill
after that stale finding was recorded as gpu_fault; steps lost came from the last periodic report,
not the last step; a hang's time was counted from the daemon's stop, not from the last step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.backends.kmsg import KernelLog, pci_key
from gpuwatch.model import GpuEvent
from gpuwatch.remediation.faults import PID_WAIT_S
from tests.helpers import SimNode, start_sim_node, wait_for
from tests.remediation.conftest import Spawn
from tests.reporting import SPIN, FakeRank

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

BOOT = 1_700_000_000.0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    """A sim daemon on real time (its ranks are real processes, started at real times), a live kernel log."""
    sim = start_sim_node(
        tmp_path,
        gpus=2,
        t0=time.time(),
        **{"trainer.grace_period_s": 5.0, "trainer.kill_after_s": 0.5, "trainer.hang_after_s": 10.0},
    )
    sim.daemon.monitor.kernel_log_readable = True
    yield sim
    sim.close()


def kernel_xid(sim: SimNode, gpu: int, xid: int, pid: int | None, ago_s: float = 0.0) -> GpuEvent:
    """The kernel log's line for an XID on `gpu`, `ago_s` seconds before the daemon's now."""
    static = sim.daemon.monitor.statics[gpu]
    line = f"NVRM: Xid (PCI:{pci_key(static.pci_bus_id)}): {xid}, pid={pid if pid else '<unknown>'}, name=python3"
    return GpuEvent(sim.clock.t - ago_s, gpu, static.uuid, "xid", xid, source="kmsg", detail=line, pid=pid)


def settle(sim: SimNode, seconds: float = 3.0) -> None:
    """Let the remediation thread act on what the ticks published (it runs on real time)."""
    for _ in range(int(seconds / 0.5)):
        sim.clock.advance(0.5)
        sim.daemon.monitor.tick()
        time.sleep(0.5)


@pytest.mark.slow
def test_a_restart_with_a_recent_app_xid_in_the_kernel_log_stops_no_healthy_job(node: SimNode, tmp_path: Path) -> None:
    """The daemon restarts 95 s after an XID 31 of a long-gone process; a new, healthy job runs: no signal."""
    rank = FakeRank("signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))")
    try:
        node.report(rank, 0, rank=0, step=10, first_step=1)
        node.daemon.monitor.tick()
        static = node.daemon.monitor.statics[0]
        usec = round((node.clock.t - 95 - BOOT) * 1e6)
        kmsg = tmp_path / "kmsg"
        kmsg.write_text(f"3,1,{usec},-;NVRM: Xid (PCI:{pci_key(static.pci_bus_id)}): 31, pid=1026, name=python3\n")
        node.daemon.kernel_log = KernelLog(str(kmsg), list(node.daemon.monitor.statics.values()), boot_t=BOOT)
        node.daemon._start_kernel_log()  # as at the daemon's start: the kernel buffer is replayed

        settle(node)

        assert [x["xid"] for x in node.gpu(0)["kernel_xids"]] == [31], "listed as history"
        assert node.incidents() == []
        assert rank.poll() is None, "the healthy job was signalled"
    finally:
        node.daemon.stop_event.set()
        rank.kill()
        rank.wait()


@pytest.mark.slow
def test_an_app_xid_of_a_process_in_no_job_stops_nothing_and_stays_a_warning(node: SimNode, spawn: Spawn) -> None:
    rank = spawn()
    node.report(rank, 0, rank=0, step=10, first_step=1)
    node.daemon.monitor.tick()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        node.daemon.monitor.handle_events([kernel_xid(node, 0, 31, stranger.pid)])
        settle(node)

        assert node.incidents() == []
        assert rank.poll() is None
        assert "xid_app" in {f["rule"] for f in node.gpu(0)["findings"]}
    finally:
        stranger.kill()
        stranger.wait()


def test_an_app_xid_that_names_a_ranks_child_stops_that_job_only(node: SimNode, spawn: Spawn, tmp_path: Path) -> None:
    worker_pid = tmp_path / "worker.pid"
    starts_a_worker = (  # a DataLoader worker or a subprocess of the rank: its pid is what the kernel log names
        "import subprocess; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(worker_pid)!r}, 'w').write(str(w.pid)); "
        "signal.signal(signal.SIGUSR1, lambda *_: (w.kill(), os._exit(75)))"
    )
    ours, theirs = FakeRank(starts_a_worker), spawn()
    try:
        node.report(ours, 0, rank=0, step=10, first_step=1)
        node.report(theirs, 0, rank=0, step=10, first_step=1, job_id="other")
        node.daemon.monitor.tick()
        worker = int(worker_pid.read_text())

        node.daemon.monitor.handle_events([kernel_xid(node, 0, 31, worker)])

        incident = wait_for(lambda: next((i for i in node.incidents() if i["kind"] == "gpu_fault"), None))
        assert incident["job"] == "job" and [r["pid"] for r in incident["ranks"]] == [ours.pid]
        assert f"from pid {worker}" in incident["reason"]
        assert ours.wait(5) == 75
        assert theirs.poll() is None, "another job on the same GPU is not this fault's"
    finally:
        ours.kill()
        ours.wait()


@pytest.mark.slow
def test_an_app_xid_with_no_pid_waits_for_the_kernel_log_then_stops_the_gpus_jobs(node: SimNode, spawn: Spawn) -> None:
    rank = spawn()
    node.report(rank, 0, rank=0, step=10, first_step=1)
    node.daemon.monitor.tick()
    static = node.daemon.monitor.statics[0]
    nvml_event = GpuEvent(node.clock.t, 0, static.uuid, "xid", 31)  # NVML's event set names no process

    node.daemon.monitor.handle_events([nvml_event])
    time.sleep(PID_WAIT_S / 2)
    assert node.incidents() == [], "the kernel log's line may still name the process"
    incident = wait_for(lambda: next(iter(node.incidents()), None), timeout_s=PID_WAIT_S + 5)

    assert incident["kind"] == "gpu_fault" and "the faulting process is unknown" in incident["reason"]
    assert rank.wait(5) == 75


def test_steps_lost_after_a_sigkill_are_the_jobs_own_count_not_its_last_report(node: SimNode, spawn: Spawn) -> None:
    """The last report says step 100; the rank reached 160 (its step page) before SIGKILL; it resumes at 150."""
    rank = spawn()
    node.report(rank, 0, rank=0, step=100, first_step=1)
    rank.page(160, first_step=1)
    node.daemon.monitor.tick()
    killed_t = time.time()
    rank.kill()

    incident = wait_for(lambda: next((i for i in node.incidents() if i["kind"] == "rank_died"), None))
    assert incident["last_step"] == 160
    assert incident["began_t"] == pytest.approx(killed_t, abs=1.0)

    relaunched = spawn()
    first_t = time.time()
    relaunched.page(151, first_step=151, step_t=first_t)
    node.report(relaunched, 0, rank=0, step=151, first_step=151, first_step_t=first_t, t=node.clock.t)

    incident = wait_for(lambda: next((i for i in node.incidents() if i["status"] == "resumed"), None))
    assert (incident["resumed_step"], incident["steps_lost"]) == (150, 10)
    assert incident["time_to_resume_s"] == pytest.approx(first_t - incident["began_t"], abs=0.01)


def test_a_hangs_time_counts_from_its_last_step(node: SimNode, spawn: Spawn) -> None:
    busy, frozen = FakeRank(SPIN), spawn()
    try:
        last_step_t = time.time()
        for process, index in ((busy, 0), (frozen, 1)):
            process.page(40, first_step=1, step_t=last_step_t)
            node.report(process, index, rank=index, step=40, first_step=1)
        os.kill(frozen.pid, signal.SIGSTOP)

        deadline = time.monotonic() + 30
        while not node.incidents():
            assert time.monotonic() < deadline, "no hang found"
            node.clock.advance(1.0)
            node.report(busy, 0, rank=0, step=40, first_step=1)
            node.daemon.monitor.tick()
            time.sleep(0.05)

        incident = wait_for(lambda: next((i for i in node.incidents() if i["status"] == "stopped"), None))
        assert incident["kind"] == "trainer_hang"
        assert incident["began_t"] == pytest.approx(last_step_t, abs=0.01), "from the last step, not the stop"
        assert incident["detected_t"] > incident["began_t"]
    finally:
        with_cont = [p for p in (busy, frozen) if p.poll() is None]
        for process in with_cont:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()


def test_a_kill_after_a_stale_xid_finding_is_a_rank_death(node: SimNode, spawn: Spawn) -> None:
    """An XID 31 of a process in no job leaves xid_app on GPU 0 for its window; then a rank there is killed."""
    stranger = subprocess.Popen([sys.executable, "-c", "pass"])
    stranger.wait()
    node.daemon.monitor.handle_events([kernel_xid(node, 0, 31, stranger.pid)])
    settle(node, 1.0)
    assert "xid_app" in {f["rule"] for f in node.gpu(0)["findings"]}
    node.clock.advance(60)  # well past FAULT_LATE_S: that XID is a finding on the GPU, not news
    rank = spawn()
    node.report(rank, 0, rank=0, step=10, first_step=1)
    node.daemon.monitor.tick()

    rank.kill()

    incident = wait_for(lambda: next(iter(node.incidents()), None))
    assert (incident["kind"], incident["reason"]) == ("rank_died", f"rank 0 (pid {rank.pid}) died")
