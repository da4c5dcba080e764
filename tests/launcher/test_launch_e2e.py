"""Quarantine and resume end to end on the CPU: a real sim daemon, `gpuwatch launch`, torchrun, 2 gloo ranks.

`gpuwatch quarantine 1` mid-run: the daemon signals the job's ranks, rank 0 checkpoints, both exit
75, launch relaunches on the one GPU left and the job resumes where it stopped. With the sim backend
the "GPUs" are the simulated ones: launch puts their UUIDs in CUDA_VISIBLE_DEVICES, and each rank
reports CUDA_VISIBLE_DEVICES[LOCAL_RANK] as its GPU, which is how the daemon finds the ranks of GPU 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess
from tests.helpers import REPO, launch_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 90


class Node(DaemonProcess):
    """A `gpuwatch run` subprocess on the sim backend (2 GPUs, 1 s), and the environment of the commands beside it."""

    def __init__(self, root: Path, **env: str) -> None:
        super().__init__(root, "--sim-scenario", "healthy", "--sim-gpus", "2", "--interval", "1", env=env)
        self.job_env = launch_env(**env)


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    with contextlib.ExitStack() as daemons:
        yield lambda **env: daemons.enter_context(Node(tmp_path, **env))


def _launch(node: Node, ckpt: Path, *example_args: str, max_restarts: int = 2) -> subprocess.Popen[str]:
    example = ["-m", "gpuwatch.examples.trainer", "--ckpt-dir", str(ckpt), "--report-interval", "0.2"]
    return _launch_job(node, ckpt.parent, *example, *example_args, max_restarts=max_restarts)


def _launch_job(node: Node, cwd: Path, *job: str, max_restarts: int = 2, nproc: str = "auto") -> subprocess.Popen[str]:
    command = node.command("launch", "--runtime-dir", str(node.runtime_dir), "--max-restarts", str(max_restarts))
    return subprocess.Popen(
        [*command, "--nproc-per-node", nproc, "--", *job],
        env=node.job_env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_ranks(node: Node, proc: subprocess.Popen[str], *, ranks: int, step: int) -> list[dict[str, Any]]:
    """The ranks' reports once each has passed `step`, as the daemon maps them (GET /v1/trainers)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = node.get("/v1/trainers")["ranks"]
        if len(found) == ranks and all((r.get("step") or 0) >= step for r in found):
            return list(found)
        assert proc.poll() is None, f"launch exited {proc.returncode} early: {proc.communicate()}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"ranks did not reach step {step}: {proc.communicate()}")


def _incident(node: Node, status: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        incidents = node.get("/v1/incidents")["incidents"]
        if incidents and incidents[0]["status"] == status:
            return dict(incidents[0])
        time.sleep(0.1)
    raise AssertionError(f"no incident reached {status!r}: {incidents}")


def test_quarantine_mid_run_checkpoints_relaunches_on_one_gpu_and_resumes(
    start_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = start_node()
    gpu1 = node.get("/v1/gpus/1")["uuid"]
    proc = _launch(node, tmp_path / "ckpt", "--steps", "150", "--step-sleep", "0.05")
    ranks = _wait_for_ranks(node, proc, ranks=2, step=20)
    assert sorted((r["gpu"], r["rank"]) for r in ranks) == [(0, 0), (1, 1)]
    job = ranks[0]["job_id"]

    subprocess.run(node.command("quarantine", "1", "--reason", "test"), env=node.job_env, check=True, timeout=30)
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)

    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["world_sizes"] == [2, 1] and summary["lost_steps"] == 0, summary
    assert (summary["steps_done"], summary["restarts"]) == (150, 1)
    assert f"gpuwatch launch: relaunch 1/2: GPU 1 ({gpu1}) left, quarantined: test" in stderr
    assert f"job {job}, 1 rank(s) on GPU 0" in stderr
    # A planned relaunch: one line per rank, not torchrun's ChildFailedError traceback.
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr
    ended = re.findall(
        r"^gpuwatch launch: rank (\d) \(local rank \1, pid \d+\) (exited 75|killed by SIGTERM): ", stderr, re.M
    )
    assert sorted(rank for rank, _ in ended) == ["0", "1"] and ("exited 75" in {how for _, how in ended}), stderr

    incident = _incident(node, "resumed")
    assert (incident["gpu"], incident["uuid"], incident["cause"], incident["job"]) == (1, gpu1, "test", job)
    assert sorted((r["rank"], r["gpu"], r["ended"]) for r in incident["ranks"]) == [(0, 0, "exited"), (1, 1, "exited")]
    assert incident["steps_lost"] == 0
    assert incident["resumed_step"] >= summary["resumed_from_steps"][0]
    assert 0 < incident["time_to_stop_s"] < 10
    assert incident["time_to_stop_s"] < incident["time_to_resume_s"] < 60
    print(
        f"\nquarantine-and-resume on the CPU: time to stop {incident['time_to_stop_s']:.2f} s, "
        f"time to resume {incident['time_to_resume_s']:.2f} s, steps lost {incident['steps_lost']} "
        f"(example: lost_steps {summary['lost_steps']}, resumed from step {summary['resumed_from_steps'][0]})"
    )


def test_a_rank_that_ignores_the_stop_is_terminated_after_the_grace_period(
    start_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = start_node(GPUWATCH_TRAINER_GRACE_PERIOD_S="1")
    args = ("--steps", "5000", "--step-sleep", "0.02", "--ignore-stop")
    proc = _launch(node, tmp_path / "ckpt", *args, max_restarts=0)
    _wait_for_ranks(node, proc, ranks=2, step=10)

    subprocess.run(node.command("quarantine", "1", "--reason", "test"), env=node.job_env, check=True, timeout=30)
    _, stderr = proc.communicate(timeout=TIMEOUT_S)

    assert proc.returncode == 3  # a crash, and no relaunch left
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gpuwatch launch: error: the job crashed (rank "), last
    assert "killed by SIGTERM" in last and last.endswith("but --max-restarts 0 is used up")
    incident = _incident(node, "stopped")
    assert {r["ended"] for r in incident["ranks"]} == {"SIGTERM"}
    assert len(incident["ranks"]) == 2
    assert 1.0 <= incident["time_to_stop_s"] < 10


# -- issue 9: sudden faults -----------------------------------------------------------------------


def _kill_rank_and_time_the_resume(
    node: Node, proc: subprocess.Popen[str], *, step: int
) -> tuple[float, int, str, str]:
    """SIGKILL rank 1 once both ranks passed `step`: seconds to the relaunch's first step, that step, the output."""
    ranks = _wait_for_ranks(node, proc, ranks=2, step=step)
    victim = next(r for r in ranks if r["rank"] == 1)
    killed_t = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        resumed = [r for r in node.trainer_reports() if r["t"] > killed_t and r.get("first_step") is not None]
        resumed = [r for r in resumed if r["pid"] not in {rank["pid"] for rank in ranks}]
        if resumed:
            break
        assert time.monotonic() < deadline and proc.poll() is None, f"no resumed step: {proc.communicate()}"
        time.sleep(0.05)
    first = min(resumed, key=lambda r: r["t"])
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    return first["t"] - killed_t, first["first_step"], stdout, stderr


def test_a_killed_rank_is_rescued_by_its_peer_and_the_job_loses_no_step(
    start_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = start_node()
    gpu1 = node.get("/v1/gpus/1")["uuid"]
    proc = _launch(node, tmp_path / "ckpt", "--steps", "120", "--step-sleep", "0.05", "--ckpt-every", "50")

    to_resume_s, first_step, stdout, stderr = _kill_rank_and_time_the_resume(node, proc, step=15)

    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    rescued = int(stderr.split("rank 0: rescued step ")[1].split()[0])
    assert (summary["steps_done"], summary["restarts"], summary["lost_steps"]) == (120, 1, 0), summary
    assert summary["resumed_from_steps"] == [rescued] and first_step == rescued + 1
    assert f"gpuwatch launch: relaunch 1/2: rank 1 on GPU 1 ({gpu1}) killed by SIGKILL after step " in stderr
    assert "daemon: no finding on GPU 1" in stderr
    # torchrun's own account of the crash goes to its log; the terminal gets one line for the rank that died
    assert "ChildFailedError" not in stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("gpuwatch launch: rank 1 (local rank 1, pid")]
    assert " killed by SIGKILL, no error line of its own; torchrun's full output: " in line, line
    assert "ChildFailedError" in Path(line.rsplit(": ", 1)[1]).read_text()
    print(f"\nrank death, rescue on the CPU: first resumed step {to_resume_s:.2f} s after the SIGKILL, 0 steps lost")


def test_without_rescue_the_job_resumes_from_the_periodic_checkpoint_and_counts_the_lost_steps(
    start_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = start_node()
    args = ("--steps", "60", "--step-sleep", "0.05", "--ckpt-every", "10", "--no-rescue")
    proc = _launch(node, tmp_path / "ckpt", *args)

    to_resume_s, first_step, stdout, stderr = _kill_rank_and_time_the_resume(node, proc, step=15)

    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    furthest = json.loads((tmp_path / "ckpt" / "progress.json").read_text())["launches"][0]["furthest"]
    (resumed,) = summary["resumed_from_steps"]
    assert resumed == furthest // 10 * 10 and first_step == resumed + 1
    assert (summary["steps_done"], summary["restarts"], summary["lost_steps"]) == (60, 1, furthest - resumed)
    assert "rescued" not in stderr
    print(f"\nrank death, no rescue: resumed {to_resume_s:.2f} s after the SIGKILL, {furthest - resumed} steps lost")


CRASHES_AT_STEP_5 = """
import time
from gpuwatch.trainer import TrainerLink

with TrainerLink(report_interval_s=0.1) as link:
    for step in range(1, 100):
        link.step(step)
        if step == 5:
            time.sleep(1)  # a periodic report carries step 5 before the crash
            raise RuntimeError("a bug at step 5")
"""


def test_a_job_that_crashes_twice_at_the_same_step_with_no_finding_stops_with_3(
    start_node: Callable[..., Node], tmp_path: Path
) -> None:
    node = start_node()
    (tmp_path / "job.py").write_text(CRASHES_AT_STEP_5)
    proc = _launch_job(node, tmp_path, "job.py", nproc="1")

    _, stderr = proc.communicate(timeout=TIMEOUT_S)

    assert proc.returncode == 3, stderr
    lines = stderr.strip().splitlines()
    assert re.fullmatch(
        r"gpuwatch launch: error: job gpuwatch-\w+ crashed twice at step 5 with no hardware finding on GPU 0: "
        r"a software fault, not relaunching",
        lines[-1],
    ), lines[-1]
    assert sum("gpuwatch launch: relaunch" in line for line in lines) == 1
    assert "gpuwatch launch: relaunch 1/2: rank 0 on GPU 0 (" in stderr and "exited 1 after step 5" in stderr


def test_a_hung_rank_is_detected_and_the_job_comes_back(start_node: Callable[..., Node], tmp_path: Path) -> None:
    node = start_node(
        GPUWATCH_TRAINER_HANG_AFTER_S="8",
        GPUWATCH_TRAINER_STALE_AFTER_S="5",  # the frozen rank's report is stale after 5 s (reports every 0.2 s)
        GPUWATCH_TRAINER_RESTART_HUNG_JOBS="true",
        GPUWATCH_TRAINER_GRACE_PERIOD_S="20",
    )
    args = ("--steps", "80", "--step-sleep", "0.05", "--ckpt-every", "50", "--gloo-timeout", "300")
    proc = _launch(node, tmp_path / "ckpt", *args)
    ranks = _wait_for_ranks(node, proc, ranks=2, step=10)
    hung = next(r["pid"] for r in ranks if r["rank"] == 1)
    os.kill(hung, signal.SIGSTOP)  # gloo waits 300 s: only the daemon gets the job out
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(hung, signal.SIGCONT)
        proc.terminate()  # launch forwards it to torchrun (its own session), which tears the ranks down
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)

    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps_done"] == 80 and summary["restarts"] >= 1 and summary["lost_steps"] == 0, summary
    (incident,) = [i for i in node.get("/v1/incidents")["incidents"] if i["kind"] == "trainer_hang"]
    assert (incident["status"], incident["steps_lost"]) == ("resumed", 0), incident
    assert "is stopped (SIGSTOP)" in incident["reason"]


def test_a_relaunch_shorter_than_one_report_interval_is_recorded_as_resumed(
    start_node: Callable[..., Node], tmp_path: Path
) -> None:
    """Issue 16: the first report carrying a step goes out at once, the last one stays after the exit."""
    node = start_node()
    proc = _launch(node, tmp_path / "ckpt", "--steps", "40", "--step-sleep", "0.05", "--report-interval", "60")
    _wait_for_ranks(node, proc, ranks=2, step=1)  # the first step's report, long before the interval
    time.sleep(0.5)

    subprocess.run(node.command("quarantine", "1", "--reason", "test"), env=node.job_env, check=True, timeout=30)
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)

    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert (summary["restarts"], summary["lost_steps"]) == (1, 0), summary
    incident = _incident(node, "resumed")
    assert incident["steps_lost"] == 0
    assert incident["resumed_step"] == summary["resumed_from_steps"][0]


def test_the_kill_rank_drill_passes_against_a_job_under_launch(tmp_path: Path) -> None:
    """`gpuwatch drill --kill-rank 1 --yes` against the 2-rank example under `gpuwatch launch` (gloo, sim daemon).

    tests/hardware/rank_drills.py is the same run the H200 check makes with NCCL: daemon, launcher,
    drill, and the job's own summary at the end.
    """
    out = tmp_path / "drills.json"
    argv = [sys.executable, str(REPO / "tests/hardware/rank_drills.py"), "--backend", "sim", "--trainers", "example"]
    argv += ["--drills", "kill_rank", "--steps", "200", "--warmup", "30", "--out", str(out)]
    done = subprocess.run(argv, env=launch_env(), capture_output=True, text=True, timeout=240)

    result = json.loads(out.read_text())
    (job,) = result["jobs"]
    assert done.returncode == 0, (job.get("error"), job.get("launch_lines"), result["daemon_log_tail"][-2000:])
    (drill,) = job["drills"]
    steps = [(s["name"], s["result"]) for s in drill["verdict"]["steps"]]
    assert steps == [("kill", "pass"), ("rank_exited", "pass"), ("rank_gone", "pass"), ("job_resumed", "pass")]
    assert drill["verdict"]["steps"][-1]["detail"].endswith(" s after the fault began, 0 step(s) lost")
    assert (job["summary"]["steps_done"], job["summary"]["lost_steps"]) == (200, 0) and job["summary"]["restarts"] >= 1
    (incident,) = [i for i in result["incidents"] if i["kind"] == "rank_died"]
    assert (incident["status"], incident["steps_lost"]) == ("resumed", 0)
