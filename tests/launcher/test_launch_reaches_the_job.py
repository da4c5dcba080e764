"""A quarantine reaches every job under `gpuwatch launch`: real sim daemon, real torchrun, real ranks on the CPU.

Launch takes the runtime dir from the daemon (a daemon with a non-default one, no --runtime-dir given), refuses
one given by hand that is not the daemon's before anything starts, and moves a job whose ranks never report off
a quarantined GPU by itself. A job whose script is missing never reaches torchrun.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launcher.test_launch_e2e import TIMEOUT_S, Node, _wait_for_ranks

pytestmark = pytest.mark.slow


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """A sim daemon of 2 GPUs whose runtime dir is <tmp_path>/run, not the default /run/gpuwatch."""
    with Node(tmp_path) as daemon:
        yield daemon


def _launch(node: Node, cwd: Path, *args: str) -> subprocess.Popen[str]:
    """`gpuwatch launch OPTIONS -- JOB` with no runtime dir given: not as a flag, not in GPUWATCH_RUNTIME_DIR."""
    env = {k: v for k, v in node.job_env.items() if k != "GPUWATCH_RUNTIME_DIR"}
    at = args.index("--")
    argv = [*node.command("launch", *args[:at]), *args[at:]]
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _quarantine(node: Node, index: int) -> None:
    subprocess.run(node.command("quarantine", str(index), "--reason", "test"), env=node.job_env, check=True, timeout=30)


def test_a_job_launched_without_a_runtime_dir_reports_to_the_daemons_own_and_a_quarantine_reaches_it(
    node: Node, tmp_path: Path
) -> None:
    assert node.runtime_dir != Path("/run/gpuwatch")
    assert node.get("/v1/daemon")["runtime_dir"] == str(node.runtime_dir)
    example = ["-m", "gpuwatch.examples.trainer", "--ckpt-dir", str(tmp_path / "ckpt"), "--report-interval", "0.2"]
    proc = _launch(node, tmp_path, "--max-restarts", "1", "--", *example, "--steps", "80", "--step-sleep", "0.05")

    ranks = _wait_for_ranks(node, proc, ranks=2, step=5)  # the daemon hears both ranks
    _quarantine(node, 1)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)

    print(stderr, end="")
    assert proc.returncode == 0, stderr
    assert {r["job_id"] for r in ranks} == {ranks[0]["job_id"]}
    assert "GPU 1 (" in stderr and "left, quarantined: test" in stderr and "1 rank(s) on GPU 0" in stderr, stderr
    assert "cannot reach" not in stderr


def test_a_runtime_dir_by_hand_that_is_not_the_daemons_is_one_line_and_exit_2_before_the_job_starts(
    node: Node, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    (tmp_path / "job.py").write_text(f"open({str(started)!r}, 'w').close()\n")
    elsewhere = tmp_path / "elsewhere"

    proc = _launch(node, tmp_path, "--runtime-dir", str(elsewhere), "--", "job.py")
    _, stderr = proc.communicate(timeout=TIMEOUT_S)

    print(stderr, end="")
    assert proc.returncode == 2
    assert stderr == (
        f"gpuwatch launch: error: --runtime-dir {elsewhere} is not the daemon's runtime dir {node.runtime_dir}: "
        "the job's ranks could not report to it, and a quarantine of their GPU would not reach them; leave it out "
        "(launch asks the daemon)\n"
    )
    assert not started.exists()


NEVER_REPORTS = """
import os, sys, time
from pathlib import Path
# A job without TrainerLink: the daemon never hears of it. Each rank notes where it runs, then works.
gpu = os.environ["CUDA_VISIBLE_DEVICES"].split(",")[int(os.environ["LOCAL_RANK"])]
(Path(sys.argv[1]) / f"{os.environ.get('GPUWATCH_RESUME', '0')}-{gpu}-{os.getpid()}").touch()
time.sleep(0.5 if os.environ.get("GPUWATCH_RESUME") else 120)
"""


def test_a_job_whose_ranks_never_report_is_stopped_and_relaunched_off_a_quarantined_gpu(
    node: Node, tmp_path: Path
) -> None:
    gpu1 = node.get("/v1/gpus/1")["uuid"]
    (tmp_path / "job.py").write_text(NEVER_REPORTS)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = _launch(node, tmp_path, "--max-restarts", "1", "--", "job.py", str(marks))
    deadline = time.monotonic() + TIMEOUT_S
    while len(list(marks.iterdir())) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)

    quarantined = time.monotonic()
    _quarantine(node, 1)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)
    took = time.monotonic() - quarantined

    print(stderr, end="")
    assert proc.returncode == 0, stderr
    assert (
        f"gpuwatch launch: relaunch 1/1: GPU 1 ({gpu1}) left, quarantined: test; none of its ranks there reports "
        "to the daemon, so launch stopped the job itself: the steps since its last checkpoint are lost"
    ) in stderr
    assert "gpuwatch launch: launch 2 (" in stderr and "1 rank(s) on GPU 0" in stderr
    resumed_on = {name.split("-", 1)[1].rsplit("-", 1)[0] for name in os.listdir(marks) if name.startswith("1-")}
    assert resumed_on == {node.get("/v1/gpus/0")["uuid"]}
    assert took < 60, took  # the first launch would have run for 120 s


@pytest.mark.parametrize(
    ("job", "said"),
    [(["missing.py"], "missing.py: no such script"), (["-m", "no_such_mod"], "no module named 'no_such_mod'")],
)
def test_a_missing_script_or_module_is_at_most_3_lines_and_exit_2(
    node: Node, tmp_path: Path, job: list[str], said: str
) -> None:

    done = subprocess.run(
        [*node.command("launch"), "--", *job],
        env=node.job_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )

    print(done.stdout + done.stderr, end="")
    assert done.returncode == 2
    assert len((done.stdout + done.stderr).splitlines()) <= 3, done.stdout + done.stderr
    assert done.stderr.startswith("gpuwatch launch: error: ") and said in done.stderr
