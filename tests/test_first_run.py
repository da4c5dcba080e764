"""A newcomer's first commands: each mistake or refusal is one line that names the flag typed and the way out,
and a first `gpuwatch run` that fails leaves nothing behind."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, child_env

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[1]


def gpuwatch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`gpuwatch ARGS` of this checkout, run in `cwd`."""
    env = {**child_env(), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_a_bad_interval_names_the_flag_that_was_typed(tmp_path: Path) -> None:
    done = gpuwatch("run", "--backend", "sim", "--interval", "0", "--state-dir", str(tmp_path / "s"), cwd=tmp_path)

    print(done.stderr, end="")
    assert done.returncode == 2
    assert done.stderr == (
        "gpuwatch: error: interval_s: 0.0 is out of range (1 to 3600 seconds) (from option --interval)\n"
    )


def test_check_on_the_sim_says_no_quarantine_as_if_kept(tmp_path: Path) -> None:
    done = gpuwatch("check", "--backend", "sim", cwd=tmp_path)

    assert done.returncode == 1
    assert "GPU 5 " in done.stdout and " unhealthy: ecc_uncorrectable" in done.stdout
    assert "quarantine" not in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize("state_dir_there", [False, True])
def test_a_run_that_fails_to_start_leaves_no_state_dir_it_made(tmp_path: Path, state_dir_there: bool) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    state = tmp_path / "gpuwatch" / "state"
    if state_dir_there:
        state.mkdir(parents=True)
        (state / "mine").write_text("an operator's file\n")

    with busy:
        done = gpuwatch(
            "run", "--backend", "sim", "--listen", f"127.0.0.1:{busy.getsockname()[1]}",
            "--state-dir", str(state), "--runtime-dir", str(tmp_path / "gpuwatch" / "run"), cwd=tmp_path,
        )  # fmt: skip

    assert done.returncode == 2 and "Address already in use" in done.stderr, done.stderr
    if state_dir_there:  # a state dir that was there is the operator's: left as it was, lock file and all
        assert (state / "mine").read_text() == "an operator's file\n"
    else:
        assert not (tmp_path / "gpuwatch").exists(), list((tmp_path / "gpuwatch").rglob("*"))


def test_the_xid_drill_on_a_busy_sim_gpu_says_how_to_get_an_idle_one(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path, "--sim-gpus", "2", "--interval", "1") as daemon:
        done = subprocess.run(
            daemon.command("drill", "--xid-fault", "0", "--yes"), env=child_env(), capture_output=True, text=True
        )

    print(done.stdout + done.stderr, end="")
    assert done.returncode != 0
    assert "GPU 0 has processes on it (" in done.stdout + done.stderr
    assert "pick a GPU without any (the sim puts a process on every GPU: run its daemon with --sim-scenario idle)" in (
        done.stdout + done.stderr
    )
