"""`gpuwatch launch`: the launch loop with a fake daemon and a fake torchrun, its guards, and signal forwarding."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatch.errors import DaemonError
from gpuwatch.launcher.launch import (
    EXIT_RESUME,
    TORCHRUN,
    Failure,
    Launcher,
    LaunchStopped,
    Outcome,
    Plan,
    cause_of,
    launch,
    rendezvous_args,
    root_cause,
    run_torchrun,
    usable,
)
from gpuwatch.launcher.torchrun_output import parse_failures
from gpuwatch.launcher.worker_plane import WORKER_SECRET_ENV, write_secret
from gpuwatch.serving.client import DaemonClient
from gpuwatch.serving.wire import DaemonInfo, Gpu
from gpuwatch.trainer.contract import LAUNCH_DIR_ENV, STEP_LAYOUT, STEP_PAGE_MAGIC, step_page_name


@pytest.fixture(autouse=True)
def _logs_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's log files (one per Launcher.run, kept after it) go to the test's own directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def gpu(index: int, state: str = "healthy", quarantined: bool = False, reason: str | None = None) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{index}{index}{index}",
        "state": state,
        "quarantined": quarantined,
        "quarantine_reason": reason,
    }


def plan(**overrides: Any) -> Plan:
    values: dict[str, Any] = {
        "nproc": None,
        "min_nproc": 1,
        "max_restarts": 3,
        "runtime_dir": "/tmp/run",
        "job_id": "job-7",
        "rendezvous": ("--nnodes", "1"),
        "command": ("-m", "train", "--lr", "3"),
        "watch_poll_s": 3600.0,  # QuarantineWatch must not take the fake daemon's scripted answers
    }
    return Plan(**{**values, **overrides})


@dataclass
class Run:
    """One scripted torchrun run: its exit code, the failed workers of its summary, the step its ranks reached."""

    rc: int = 1
    failures: tuple[Failure, ...] = ()
    step: int | None = None
    first_step: int = 1
    error_code: int | None = None  # the root cause's error file (only when the worker left one)


def killed(local_rank: int, sig: int = signal.SIGKILL) -> Failure:
    return Failure(rank=local_rank, local_rank=local_rank, exitcode=-sig, pid=100 + local_rank)


def exited(local_rank: int, code: int) -> Failure:
    return Failure(rank=local_rank, local_rank=local_rank, exitcode=code, pid=100 + local_rank)


class FakeTorchrun:
    """Ends each launch as scripted: 0, (rc, root-cause errorCode) written to the error file as torchrun
    does, or a Run (whose ranks leave a report in the runtime dir with the step they reached)."""

    def __init__(self, *outcomes: int | tuple[int, int] | Run) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, argv: list[str], env: dict[str, str], *_stop_and_log: object) -> Outcome:
        self.calls.append((argv, env))
        outcome = self.outcomes.pop(0)
        if outcome == 0:
            return Outcome(0)
        if isinstance(outcome, tuple):
            outcome = Run(outcome[0], (exited(0, outcome[1]),), error_code=outcome[1])
        assert isinstance(outcome, Run)
        if outcome.error_code is not None:
            code = outcome.error_code
            error = {"message": {"message": f"worker said {code}\ntraceback", "errorCode": code, "extraInfo": {}}}
            Path(env["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps(error))
        if outcome.step is not None:  # the rank's step page, as TrainerLink leaves it in the launch's directory
            page = Path(env[LAUNCH_DIR_ENV]) / step_page_name(1000 + len(self.calls))
            page.write_bytes(
                STEP_LAYOUT.pack(STEP_PAGE_MAGIC, outcome.step, outcome.first_step, time.time(), time.time())
            )
        return Outcome(outcome.rc, None, outcome.failures)


class FakeDaemon:
    """GET /v1/gpus answers, one list per call (the last repeats); None: the daemon cannot be reached."""

    def __init__(self, *answers: list[dict[str, Any]] | None) -> None:
        self.answers = list(answers)

    def __call__(self) -> list[Gpu]:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if answer is None:
            raise DaemonError("cannot reach the gpuwatch daemon at http://127.0.0.1:9835: refused")
        return [Gpu.model_validate(g) for g in answer]


def test_stop_for_resume_relaunches_on_the_gpus_left_with_resume_set() -> None:
    daemon = FakeDaemon([gpu(0), gpu(1), gpu(2, "unhealthy")], [gpu(0), gpu(1, "degraded", True, "test"), gpu(2)])
    torchrun = FakeTorchrun((1, EXIT_RESUME), 0)
    lines: list[str] = []

    assert Launcher(plan(), daemon, torchrun, lines.append).run() == 0

    (argv1, env1), (argv2, env2) = torchrun.calls
    log_dir = argv1[argv1.index("--log-dir") + 1]
    assert argv1[1:] == [
        "-m", "gpuwatch.launcher.local_rendezvous", "--max-restarts", "0", "--nproc-per-node", "2",
        "--log-dir", log_dir, "--tee", "2", "--nnodes", "1", "-m", "--", "train", "--lr", "3",
    ]  # fmt: skip
    assert argv1[0] == sys.executable
    assert env1["CUDA_VISIBLE_DEVICES"] == "GPU-000,GPU-111" and "GPUWATCH_RESUME" not in env1
    assert argv2[argv2.index("--nproc-per-node") + 1] == "2"  # GPU 2 came back; GPU 1 left
    assert env2["CUDA_VISIBLE_DEVICES"] == "GPU-000,GPU-222" and env2["GPUWATCH_RESUME"] == "1"
    for env in (env1, env2):
        assert (env["GPUWATCH_JOB_ID"], env["GPUWATCH_RUNTIME_DIR"]) == ("job-7", "/tmp/run")
    assert env1["TORCHELASTIC_ERROR_FILE"] != env2["TORCHELASTIC_ERROR_FILE"]
    assert lines == [
        "gpuwatch launch: launch 1 (first launch): job job-7, 2 rank(s) on GPU 0,1",
        "gpuwatch launch: relaunch 1/3: GPU 1 (GPU-111) left, quarantined: test",
        "gpuwatch launch: launch 2 (GPU 1 (GPU-111) left, quarantined: test): job job-7, 2 rank(s) on GPU 0,2",
        "gpuwatch launch: job job-7 finished after 1 relaunch(es)",
    ]


def test_nproc_caps_the_ranks_and_a_stop_with_every_gpu_usable_says_so() -> None:
    torchrun = FakeTorchrun((1, EXIT_RESUME), 0)
    lines: list[str] = []

    Launcher(plan(nproc=1), FakeDaemon([gpu(0), gpu(1)]), torchrun, lines.append).run()

    assert [c[1]["CUDA_VISIBLE_DEVICES"] for c in torchrun.calls] == ["GPU-000", "GPU-000"]
    assert (
        lines[1]
        == "gpuwatch launch: relaunch 1/3: the job stopped for resume (worker said 75) with all its GPUs usable"
    )


def test_fewer_usable_gpus_than_min_nproc_stops_with_3() -> None:
    daemon = FakeDaemon([gpu(0), gpu(1)], [gpu(0), gpu(1, quarantined=True)])
    torchrun = FakeTorchrun((1, EXIT_RESUME))

    with pytest.raises(LaunchStopped) as stopped:
        Launcher(plan(min_nproc=2), daemon, torchrun, lambda _: None).run()

    assert (stopped.value.code, str(stopped.value)) == (3, "1 usable GPU(s) on this node, fewer than --min-nproc 2")
    assert len(torchrun.calls) == 1


def test_max_restarts_stops_with_3() -> None:
    torchrun = FakeTorchrun((1, EXIT_RESUME), (1, EXIT_RESUME))

    with pytest.raises(LaunchStopped) as stopped:
        Launcher(plan(max_restarts=1), FakeDaemon([gpu(0)]), torchrun, lambda _: None).run()

    assert stopped.value.code == 3
    assert str(stopped.value) == "the job stopped for resume, but --max-restarts 1 is used up"


def test_a_killed_rank_relaunches_naming_the_rank_gpu_signal_and_the_daemons_finding(tmp_path: Path) -> None:
    xid = {"rule": "xid", "reason": "XID 31 (application fault)"}
    daemon = FakeDaemon([gpu(0), gpu(1)], [gpu(0), {**gpu(1), "findings": [xid]}])
    teardown = (killed(1), exited(0, EXIT_RESUME))  # the survivor rescued and exited 75; the root cause is rank 1
    torchrun = FakeTorchrun(Run(1, teardown, step=37), Run(0, step=50, first_step=41))
    lines: list[str] = []

    assert Launcher(plan(runtime_dir=str(tmp_path)), daemon, torchrun, lines.append).run() == 0

    assert lines[1] == (
        "gpuwatch launch: relaunch 1/3: rank 1 on GPU 1 (GPU-111) killed by SIGKILL after step 37, "
        "daemon: GPU 1 xid: XID 31 (application fault)"
    )
    assert lines[3] == "gpuwatch launch: launch 2 resumed from step 40"  # as soon as a rank reported first_step 41
    assert torchrun.calls[1][1]["CUDA_VISIBLE_DEVICES"] == "GPU-000,GPU-111"  # a finding alone does not condemn
    assert torchrun.calls[1][1]["GPUWATCH_RESUME"] == "1"


def test_a_nonzero_exit_relaunches_on_the_gpus_left() -> None:
    daemon = FakeDaemon([gpu(0), gpu(1)], [gpu(0), gpu(1, "unhealthy", True, "xid 79")])
    torchrun = FakeTorchrun(Run(1, (exited(1, 7),)), 0)
    lines: list[str] = []

    assert Launcher(plan(), daemon, torchrun, lines.append).run() == 0

    assert lines[1] == (
        "gpuwatch launch: relaunch 1/3: rank 1 on GPU 1 (GPU-111) exited 7 (no rank reports its steps), "
        "daemon: GPU 1 quarantined: xid 79; GPU 1 (GPU-111) left, quarantined: xid 79"
    )
    assert torchrun.calls[1][1]["CUDA_VISIBLE_DEVICES"] == "GPU-000"


def test_a_crash_at_the_same_step_with_no_finding_is_a_software_fault_exit_3(tmp_path: Path) -> None:
    torchrun = FakeTorchrun(Run(1, (exited(0, 1),), step=12), Run(1, (exited(0, 1),), step=12), 0)
    lines: list[str] = []

    with pytest.raises(LaunchStopped) as stopped:
        Launcher(plan(runtime_dir=str(tmp_path)), FakeDaemon([gpu(0), gpu(1)]), torchrun, lines.append).run()

    assert stopped.value.code == 3
    assert str(stopped.value) == (
        "job job-7 crashed twice at step 12 with no hardware finding on GPU 0,1: a software fault, not relaunching"
    )
    assert len(torchrun.calls) == 2


def test_crashes_that_progress_or_have_a_finding_keep_relaunching(tmp_path: Path) -> None:
    ecc = {"rule": "ecc_dbe", "reason": "double-bit ECC error"}
    daemon = FakeDaemon([gpu(0)], [gpu(0)], [{**gpu(0), "state": "degraded", "findings": [ecc]}])
    crashes = [Run(1, (killed(0),), step=s) for s in (10, 20, 20)]  # 20 > 10: progress; then 20 again, with ECC
    torchrun = FakeTorchrun(*crashes, 0)

    assert Launcher(plan(runtime_dir=str(tmp_path)), daemon, torchrun, lambda _: None).run() == 0
    assert len(torchrun.calls) == 4


def test_crashes_count_against_max_restarts() -> None:
    torchrun = FakeTorchrun(Run(1, (killed(0),)))

    with pytest.raises(LaunchStopped) as stopped:
        Launcher(plan(max_restarts=0), FakeDaemon([gpu(0)]), torchrun, lambda _: None).run()

    assert (stopped.value.code, str(stopped.value)) == (
        3,
        "the job crashed (rank 0 on GPU 0 (GPU-000) killed by SIGKILL (no rank reports its steps), daemon: no finding "
        "on GPU 0), but --max-restarts 0 is used up",
    )


def test_an_unreachable_daemon_relaunches_on_the_same_gpus_and_says_so() -> None:
    daemon = FakeDaemon([gpu(0), gpu(1)], None)
    torchrun = FakeTorchrun(Run(1, (killed(1),)), Run(1, (killed(1),)), 0)
    lines: list[str] = []

    assert Launcher(plan(), daemon, torchrun, lines.append).run() == 0

    assert lines[1] == (
        "gpuwatch launch: cannot reach the gpuwatch daemon at http://127.0.0.1:9835: refused: "
        "relaunching on the same GPUs"
    )
    assert "killed by SIGKILL (no rank reports its steps), daemon not reachable" in lines[2]
    assert [c[1]["CUDA_VISIBLE_DEVICES"] for c in torchrun.calls] == ["GPU-000,GPU-111"] * 3  # no crash-loop verdict


def test_a_failure_torchrun_does_not_name_points_at_the_log(tmp_path: Path) -> None:
    torchrun = FakeTorchrun(Run(2), Run(2))
    lines: list[str] = []

    with pytest.raises(LaunchStopped, match=r"crashed twice \(no rank reports its steps\)"):
        Launcher(plan(), FakeDaemon([gpu(0)]), torchrun, lines.append).run()
    assert lines[1] == (
        "gpuwatch launch: relaunch 1/3: torchrun exited 2 (no rank reports its steps), no worker named: "
        f"see its full output in {next(tmp_path.glob('gpuwatch-launch-job-7-*.log'))}"
    )


def test_a_forwarded_signal_never_relaunches() -> None:
    def torchrun(argv: list[str], env: dict[str, str], *_stop_and_log: object) -> Outcome:
        Path(env["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps({"message": {"errorCode": 75}}))
        return Outcome(1, signal.SIGTERM, (exited(0, EXIT_RESUME),))

    with pytest.raises(LaunchStopped) as stopped:
        Launcher(plan(), FakeDaemon([gpu(0)]), torchrun, lambda _: None).run()

    assert (stopped.value.code, str(stopped.value)) == (1, "stopped by SIGTERM; torchrun exited 1")


def test_usable_skips_quarantined_and_unhealthy_keeps_degraded_and_sorts() -> None:
    gpus = [Gpu.model_validate(g) for g in (gpu(3), gpu(0, "unhealthy"), gpu(2, "degraded"), gpu(1, quarantined=True))]

    assert [g.index for g in usable(gpus)] == [2, 3]


def test_rendezvous_single_node_pins_the_run_id() -> None:
    common: dict[str, Any] = dict.fromkeys(
        ("nnodes", "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "node_rank", "master_addr", "master_port")
    )
    expected = ("--nnodes", "1", "--rdzv-backend", "gpuwatch-local", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "j")

    assert rendezvous_args(**common, standalone=False, job_id="j") == expected
    assert rendezvous_args(**common, standalone=True, job_id="j") == expected
    multi = {**common, "nnodes": "2:4", "rdzv_backend": "c10d", "rdzv_endpoint": "head:29400", "rdzv_conf": "a=1"}
    assert rendezvous_args(**multi, standalone=False, job_id="j") == (
        "--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "j",
        "--rdzv-conf", "a=1",
    )  # fmt: skip
    static = {**common, "master_addr": "10.0.0.1", "master_port": 29500, "node_rank": 0}
    assert rendezvous_args(**static, standalone=False, job_id="j") == (
        "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29500", "--rdzv-id", "j",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"message": {"message": "gpuwatch: stopped\nmore", "errorCode": 75}}, (75, "gpuwatch: stopped")),
        ({"message": "plain text", "errorCode": 3}, (3, "plain text")),
        ({"message": {"message": "no code"}}, (None, "no code")),
        ([1, 2], (None, "")),
    ],
)
def test_root_cause(tmp_path: Path, body: Any, expected: tuple[int | None, str]) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps(body))

    assert root_cause(path) == expected
    assert root_cause(tmp_path / "missing.json") == (None, "")


SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
kill.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_21:09:18
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 75 (pid: 13878)
  error_file: /tmp/x/error.json
  traceback : gpuwatch: stopped for resume (rescued step 3)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_21:09:18
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 13879)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 13879
============================================================
"""  # torchrun 2.13's closing summary, as test_launch_e2e.py sees it for real


def test_parse_failures_reads_torchruns_summary_root_cause_first() -> None:
    assert parse_failures("worker output\n" + SUMMARY) == (
        Failure(rank=1, local_rank=1, exitcode=-9, pid=13879),
        Failure(rank=0, local_rank=0, exitcode=75, pid=13878),
    )
    assert parse_failures("no summary at all") == ()
    assert killed(1).how() == "killed by SIGKILL" and exited(0, 7).how() == "exited 7"


def test_the_cause_is_a_real_failure_over_a_75_or_a_teardown_of_the_same_second() -> None:
    assert cause_of([exited(0, EXIT_RESUME), killed(1)]) == killed(1)
    assert cause_of([killed(0, signal.SIGTERM), exited(1, 3)]) == exited(1, 3)
    assert cause_of([exited(0, EXIT_RESUME), exited(1, EXIT_RESUME)]) == exited(0, EXIT_RESUME)
    assert cause_of([]) is None


# -- the click command: every refusal is one line -------------------------------------------------


@pytest.fixture
def daemon_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[dict[str, Any]]]:
    """A daemon with GPUs 0 and 1 and runtime dir /run/gpuwatch; the jobs' scripts in the cwd."""
    gpus = [gpu(0), gpu(1)]
    monkeypatch.setattr(DaemonClient, "gpus", lambda self: [Gpu.model_validate(g) for g in gpus])
    monkeypatch.setattr(DaemonClient, "daemon_info", lambda self: DaemonInfo(runtime_dir="/run/gpuwatch"))
    monkeypatch.delenv("GPUWATCH_RUNTIME_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    for script in ("train.py", "t.py"):
        (tmp_path / script).touch()
    yield gpus


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(launch, list(args))
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "zero", "--", "train.py"], "'zero' is neither a positive number nor 'auto'"),
        (["--min-nproc", "0", "--", "train.py"], "--min-nproc"),
        ([], "Missing argument"),
        (["--", "--lr", "3"], "expected [-m] SCRIPT after the options, not '--lr'"),
        (["--", "-m"], "-m needs a module name"),
        (["--standalone", "--nnodes", "2", "--rdzv-id", "x", "--", "t.py"], "--standalone cannot be combined"),
        (["--nnodes", "2", "--", "train.py"], "a multi-node job needs --rdzv-id"),
        (["--listen", "nowhere", "--", "train.py"], "listen: 'nowhere' is not HOST:PORT"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    daemon_gpus: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.delenv("GPUWATCH_JOB_ID", raising=False)

    code, stderr = invoke(*args)

    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("gpuwatch launch: error: ") and message in stderr


def test_too_few_gpus_is_one_line_and_exit_3(daemon_gpus: list[dict[str, Any]], tmp_path: Path) -> None:
    code, stderr = invoke("--min-nproc", "3", "--state-dir", str(tmp_path), "--", "train.py")

    assert (code, stderr) == (3, "gpuwatch launch: error: 2 usable GPU(s) on this node, fewer than --min-nproc 3\n")


def test_no_daemon_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    code, stderr = invoke("--listen", "127.0.0.1:1", "--state-dir", str(tmp_path), "--", "train.py")

    assert code == 2
    assert stderr.startswith(
        f"gpuwatch launch: error: cannot reach the gpuwatch daemon: no control socket at {tmp_path}"
    )
    assert len(stderr.splitlines()) == 1


# -- signals reach torchrun ---------------------------------------------------------------------------


def test_sigterm_to_the_launcher_is_forwarded_to_torchrun_once(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    child = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(30)\n"
    )

    def terminate_us() -> None:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_us, daemon=True).start()

    assert run_torchrun([sys.executable, "-c", child], dict(os.environ)) == Outcome(7, signal.SIGTERM, ())
    assert signal.getsignal(signal.SIGTERM) == previous


def _run_real_torchrun(tmp_path: Path, job: str, capfdbinary: pytest.CaptureFixture[bytes]) -> tuple[Outcome, str]:
    """Real torchrun (2 ranks, --max-restarts 0, launch's --tee) on `job` through run_torchrun: how it ended, and
    what launch showed on its stderr."""
    script = tmp_path / "job.py"
    script.write_text(job)
    argv = [*TORCHRUN, "--max-restarts", "0", "--nproc-per-node", "2"]
    argv += ["--log-dir", str(tmp_path / "logs"), "--tee", "2", "--nnodes", "1"]
    argv += ["--rdzv-backend", "gpuwatch-local", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "t", str(script)]
    log = tmp_path / "torchrun.log"
    secret = str(write_secret(tmp_path / "secret"))  # the one-node rendezvous's store proves it
    outcome = run_torchrun(argv, {**os.environ, "OMP_NUM_THREADS": "1", WORKER_SECRET_ENV: secret}, log_path=str(log))
    assert b"ChildFailedError" in log.read_bytes()  # torchrun's whole account is in the log
    return outcome, capfdbinary.readouterr().err.decode()


ENDS_WITH = """
import os, sys, time
rank = int(os.environ['RANK'])
print(f'rank {rank}: checkpoint saved', file=sys.stderr, flush=True)
time.sleep(0.5 * (1 - rank))  # rank 1 ends first, rank 0 may be torn down by torchrun
CODES = %r
if CODES[rank] == 'raise':
    raise ValueError(f'boom in rank {rank}')
sys.exit(CODES[rank])
"""


@pytest.mark.slow
def test_a_planned_stop_prints_one_line_per_rank_instead_of_torchruns_traceback(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    _, shown = _run_real_torchrun(tmp_path, ENDS_WITH % ((75, 75),), capfdbinary)
    assert "Traceback" not in shown and "ChildFailedError" not in shown and "failed (exitcode" not in shown, shown
    assert "closing signal" not in shown
    assert "rank 0: checkpoint saved" in shown and "rank 1: checkpoint saved" in shown  # the ranks' own lines stay
    said = [re.sub(r"pid \d+", "pid N", line) for line in shown.splitlines() if line.startswith("gpuwatch launch:")]
    assert said[1] == "gpuwatch launch: rank 1 (local rank 1, pid N) exited 75: stopped for resume"
    assert said[0] in {
        "gpuwatch launch: rank 0 (local rank 0, pid N) exited 75: stopped for resume",
        "gpuwatch launch: rank 0 (local rank 0, pid N) killed by SIGTERM: stopped by torchrun once a peer had stopped",
    }
    assert len(said) == 2


@pytest.mark.slow
def test_a_crash_is_one_line_naming_the_rank_its_exit_its_own_error_and_the_log(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    outcome, shown = _run_real_torchrun(tmp_path, ENDS_WITH % ((0, "raise"),), capfdbinary)
    print(shown, end="")

    assert "ChildFailedError" not in shown and "closing signal" not in shown, shown
    assert "ValueError: boom in rank 1" in shown  # the rank's own traceback is its output: it stays
    said = [line for line in shown.splitlines() if line.startswith("gpuwatch launch:")]
    assert said == [
        f"gpuwatch launch: rank 1 (local rank 1, pid {outcome.failures[0].pid}) exited 1, its last error line: "
        f"ValueError: boom in rank 1; torchrun's full output: {tmp_path / 'torchrun.log'}"
    ], shown
