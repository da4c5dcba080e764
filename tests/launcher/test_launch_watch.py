"""Launch's own watch on its GPUs (QuarantineWatch) and its sorting of torchrun's output (TorchrunOutput)."""

from __future__ import annotations

import io
from typing import Any

from gpuwatch.launcher.gpu_watch import MARGIN_S, QuarantineWatch, StopSwitch
from gpuwatch.launcher.torchrun_output import TorchrunOutput
from gpuwatch.serving.wire import Gpu


def gpu(index: int, quarantined: bool = False, **extra: Any) -> Gpu:
    return Gpu.model_validate(
        {"index": index, "uuid": f"GPU-{index}", "quarantined": quarantined, "quarantine_reason": "xid 79", **extra}
    )


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watch(clock: Clock) -> tuple[QuarantineWatch, StopSwitch]:
    switch = StopSwitch()
    return QuarantineWatch(lambda: [], [gpu(0), gpu(1)], "job-7", switch, grace_s=60.0, clock=clock), switch


def test_a_quarantined_gpu_with_no_rank_the_daemon_knows_stops_the_launch_at_once() -> None:
    clock = Clock()
    quarantine, switch = watch(clock)

    quarantine.check([gpu(0), gpu(1, True, ranks=[{"pid": 9, "job_id": "another-job"}]), gpu(2, True)])

    assert switch.stopped
    assert switch.reason == (
        "GPU 1 (GPU-1) left, quarantined: xid 79; none of its ranks there reports to the daemon, so launch stopped "
        "the job itself: the steps since its last checkpoint are lost"
    )


def test_a_rank_the_daemon_stops_itself_gets_the_grace_period_and_a_margin_first() -> None:
    clock = Clock()
    quarantine, switch = watch(clock)
    reported = gpu(1, True, ranks=[{"pid": 9, "job_id": "job-7"}])

    quarantine.check([gpu(0), reported])
    clock.t += 60.0 + MARGIN_S - 1
    quarantine.check([gpu(0), reported])
    assert not switch.stopped

    clock.t += 1
    quarantine.check([gpu(0), gpu(1, True)])  # its ranks stopped and left the list; torchrun has not ended
    assert switch.stopped and "the job was still on it 75 s later" in (switch.reason or "")


def test_a_rank_seen_before_the_quarantine_counts_though_it_stopped_before_the_next_poll() -> None:
    quarantine, switch = watch(Clock())

    quarantine.check([gpu(0), gpu(1, ranks=[{"pid": 9, "job_id": "job-7", "ended": "resume"}])])
    quarantine.check([gpu(0), gpu(1, True)])

    assert not switch.stopped


def test_gpus_not_quarantined_or_not_the_launchs_change_nothing() -> None:
    quarantine, switch = watch(Clock())

    quarantine.check([gpu(0), gpu(1), gpu(2, True)])

    assert not switch.stopped


def test_workers_lines_reach_the_terminal_torchruns_own_only_the_log() -> None:
    log, terminal = io.BytesIO(), io.BytesIO()
    output = TorchrunOutput(log, terminal)
    stream = (
        b"W1202 05:44:52.635000 8177 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8247 "
        b"closing signal SIGTERM\n[default1]:Traceback (most recent call last):\n[default1]:ValueError: boom\n"
        b"[default0]:step 3\nFailures:\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 8248)\n"
    )

    for at in range(0, len(stream), 7):  # torchrun's pipe, read in small pieces
        output.feed(stream[at : at + 7])
    output.finish()

    assert log.getvalue() == stream
    assert terminal.getvalue() == b"[default1]:Traceback (most recent call last):\n[default1]:ValueError: boom\n" + (
        b"[default0]:step 3\n"
    )
    assert output.last_error == {1: "ValueError: boom"}
