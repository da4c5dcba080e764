"""`gpuwatch launch --in-place`: what it refuses (one line, exit 2 or 3) before it starts anything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.launcher.launch import launch
from gpuwatch.serving.client import DaemonClient
from gpuwatch.serving.wire import DaemonInfo, Gpu


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A daemon with GPUs 0 and 1 (runtime dir /run/gpuwatch); the jobs' scripts in the cwd."""
    gpus = [Gpu(index=i, uuid=f"GPU-{i}", state="healthy") for i in (0, 1)]
    monkeypatch.setattr(DaemonClient, "gpus", lambda self: gpus)
    monkeypatch.setattr(DaemonClient, "daemon_info", lambda self: DaemonInfo(runtime_dir="/run/gpuwatch"))
    monkeypatch.delenv("GPUWATCH_JOB_ID", raising=False)
    monkeypatch.delenv("GPUWATCH_RUNTIME_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    for script in ("train.py", "t.py"):
        (tmp_path / script).touch()
    yield


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--master-port", "29500"], "--in-place runs its own store: --master-port apply to torchrun only"),
        (["--rdzv-backend", "etcd", "--rdzv-conf", "a=1"], "--rdzv-conf, --rdzv-backend apply to torchrun only"),
        (["--nnodes", "2", "--rdzv-id", "j"], "a multi-node --in-place job needs --rdzv-endpoint HOST:PORT"),
        (
            ["--rdzv-endpoint", "nowhere", "--nnodes", "2", "--rdzv-id", "j", "--inplace-secret-file", "s"],
            "--rdzv-endpoint 'nowhere' is not HOST:PORT",
        ),
        (
            ["--rdzv-endpoint", "127.0.0.1:29400", "--nnodes", "2", "--rdzv-id", "j"],
            "--in-place with --rdzv-endpoint needs --inplace-secret-file (the job's secret)",
        ),
    ],
)
def test_flags_that_do_not_apply_are_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(launch, ["--in-place", "--state-dir", str(tmp_path), *args, "--", "train.py"])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("gpuwatch launch: error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_too_few_usable_gpus_is_one_line_and_exit_3(tmp_path: Path) -> None:
    result = CliRunner().invoke(launch, ["--in-place", "--min-nproc", "3", "--state-dir", str(tmp_path), "--", "t.py"])
    assert (result.exit_code, result.stderr) == (
        3,
        "gpuwatch launch: error: 2 usable GPU(s) on this node, fewer than --min-nproc 3\n",
    )


def test_inplace_secret_file_without_in_place_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(launch, ["--inplace-secret-file", "s", "--state-dir", str(tmp_path), "--", "t.py"])
    assert (result.exit_code, result.stderr) == (
        2,
        "gpuwatch launch: error: --inplace-secret-file applies to --in-place only\n",
    )


def test_a_secret_file_others_can_read_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path) -> None:
    secret = tmp_path / "job.secret"
    secret.write_text("a" * 64)
    secret.chmod(0o644)
    args = ["--in-place", "--rdzv-endpoint", "127.0.0.1:29400", "--inplace-secret-file", str(secret)]
    result = CliRunner().invoke(launch, [*args, "--state-dir", str(tmp_path), "--", "t.py"])
    assert (result.exit_code, result.stderr) == (
        2,
        f"gpuwatch launch: error: secret file {secret}: mode 644: others may read it (chmod 600)\n",
    )
