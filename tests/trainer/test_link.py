"""TrainerLink: the trainers/<pid>.json report, stop requests by signal and by status.json."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from gpuwatch.trainer import EXIT_RESUME, TrainerLink, bench_step

CONTRACT_FIELDS = {
    "t", "pid", "rank", "local_rank", "world_size", "local_world_size", "job_id", "gpu_uuid", "step",
    "step_time_s", "grad_norm", "grad_norm_var", "reserved_bytes", "allocated_bytes", "inactive_split_bytes",
    "num_alloc_retries", "num_ooms", "stop_requested", "first_step", "allow_drills", "ended",
}  # fmt: skip
FAST = 0.02


@pytest.fixture(autouse=True)
def _torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun gives the second local rank of a job on a node started by `gpuwatch launch`."""
    for key in ("GPUWATCH_RUNTIME_DIR", "GPUWATCH_JOB_ID", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")


@pytest.fixture
def restore_sigusr1() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def _read_report(path: Path) -> dict[str, object] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _write_status(runtime_dir: Path, quarantined: dict[str, bool]) -> None:
    gpus: list[dict[str, object]] = [
        {"index": i, "uuid": uuid, "state": "unhealthy" if q else "healthy", "quarantined": q, "epoch": int(q),
         "findings": []}
        for i, (uuid, q) in enumerate(quarantined.items())
    ]  # fmt: skip
    tmp = runtime_dir / "status.json.tmp"
    tmp.write_text(json.dumps({"t": time.time(), "gpus": gpus}))
    os.replace(tmp, runtime_dir / "status.json")


def test_report_has_the_contract_fields(tmp_path: Path) -> None:
    path = tmp_path / "trainers" / f"{os.getpid()}.json"
    with TrainerLink(tmp_path, report_interval_s=FAST, stop_signal=None) as link:
        for step, grad_norm in enumerate([1.0, 2.0, 3.0, float("nan")], start=1):
            link.step(step, loss=0.5, grad_norm=grad_norm)
        _wait_for(lambda: (_read_report(path) or {}).get("step") == 4)
        report = _read_report(path)
        assert link.gpu_uuid == "GPU-b"
        assert link.last_loss == 0.5

    assert report is not None
    assert set(report) == CONTRACT_FIELDS
    assert report["pid"] == os.getpid()
    assert (report["rank"], report["local_rank"], report["world_size"], report["local_world_size"]) == (5, 1, 8, 2)
    assert report["job_id"] == "job-42"
    assert report["gpu_uuid"] == "GPU-b"
    assert report["grad_norm"] is None  # NaN: strict JSON has none, so null
    assert report["grad_norm_var"] == pytest.approx(2 / 3)  # of the finite ones
    assert isinstance(report["step_time_s"], float) and report["step_time_s"] >= 0
    assert report["reserved_bytes"] is None and report["num_ooms"] is None  # no CUDA here
    assert report["stop_requested"] is False
    assert abs(float(report["t"]) - time.time()) < 5  # type: ignore[arg-type]
    assert (report["first_step"], report["allow_drills"], report["ended"]) == (1, False, None)
    final = _read_report(path)  # left on close, for the daemon to read and remove
    assert final is not None and (final["ended"], final["step"], final["first_step"]) == ("finished", 4, 1)
    assert [p.name for p in (tmp_path / "trainers").iterdir()] == [path.name]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o644


def test_defaults_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("GPUWATCH_JOB_ID", "slurm-7")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key)
    with TrainerLink(stop_signal=None) as link:
        assert link.runtime_dir == tmp_path
        report = link.report()
    assert report["job_id"] == "slurm-7"
    assert report["rank"] is None and report["local_rank"] is None
    assert report["gpu_uuid"] == "GPU-a"  # no LOCAL_RANK: the first entry
    assert report["step"] is None and report["step_time_s"] is None and report["grad_norm_var"] is None


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("GPU-x", "GPU-x"), ("0,1", None), ("", None), ("GPU-a", "GPU-a"), ("GPU-a,GPU-b,GPU-c", "GPU-b")],
)
def test_gpu_uuid_from_cuda_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str, expected: str | None
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with TrainerLink(tmp_path, stop_signal=None) as link:
        assert link.gpu_uuid == expected


def test_explicit_gpu_uuid_wins(tmp_path: Path) -> None:
    with TrainerLink(tmp_path, stop_signal=None, gpu_uuid="GPU-given") as link:
        assert link.gpu_uuid == "GPU-given"


def test_stop_signal_sets_stop_requested(tmp_path: Path, restore_sigusr1: None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    with TrainerLink(tmp_path, report_interval_s=FAST) as link:
        assert not link.stop_requested
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: link.stop_requested)
        assert link.stop_reason == "signal SIGUSR1"
        path = tmp_path / "trainers" / f"{os.getpid()}.json"
        _wait_for(lambda: (_read_report(path) or {}).get("stop_requested") is True)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back on close


def test_previous_handler_is_chained_and_restored(tmp_path: Path, restore_sigusr1: None) -> None:
    seen: list[tuple[int, bool]] = []
    links: list[TrainerLink] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        seen.append((signum, links[0].stop_requested))

    signal.signal(signal.SIGUSR1, previous)
    with TrainerLink(tmp_path, stop_signal=signal.SIGUSR1) as link:
        links.append(link)
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: seen)
    assert seen == [(signal.SIGUSR1, True)]  # called after the flag was set
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_ignored_signal_is_not_chained(tmp_path: Path, restore_sigusr1: None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with TrainerLink(tmp_path) as link:
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: link.stop_requested)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_no_handler_off_the_main_thread(tmp_path: Path, restore_sigusr1: None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    links: list[TrainerLink] = []
    thread = threading.Thread(target=lambda: links.append(TrainerLink(tmp_path)))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    links[0].close()


def test_quarantine_in_status_json_requests_a_stop(tmp_path: Path) -> None:
    _write_status(tmp_path, {"GPU-a": True, "GPU-b": False})  # the neighbour's GPU: not ours
    with TrainerLink(tmp_path, report_interval_s=FAST, stop_signal=None) as link:
        time.sleep(10 * FAST)
        assert not link.stop_requested

        _write_status(tmp_path, {"GPU-a": True, "GPU-b": True})
        _wait_for(lambda: link.stop_requested)
        assert link.stop_reason == "gpuwatch quarantined GPU-b"

        _write_status(tmp_path, {"GPU-a": True, "GPU-b": False})  # a stop request is never taken back
        time.sleep(5 * FAST)
        assert link.stop_requested


def test_malformed_status_json_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{not json")
    with TrainerLink(tmp_path, report_interval_s=FAST, stop_signal=None) as link:
        time.sleep(5 * FAST)
        assert not link.stop_requested
        _write_status(tmp_path, {"GPU-b": True})
        _wait_for(lambda: link.stop_requested)


def test_missing_runtime_dir_is_not_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with TrainerLink(tmp_path / "no-daemon", report_interval_s=FAST, stop_signal=None) as link:
        link.step(1)
        time.sleep(10 * FAST)
    warnings = [r for r in caplog.records if "report not written" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warnings) == 1  # said once, not every interval


def test_exit_for_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    link = TrainerLink(tmp_path, report_interval_s=FAST, stop_signal=None)
    path = tmp_path / "trainers" / f"{os.getpid()}.json"
    _wait_for(path.exists)
    link.request_stop("test")

    with pytest.raises(SystemExit) as excinfo:
        link.exit_for_resume()

    assert excinfo.value.code == EXIT_RESUME == 75
    assert (_read_report(path) or {})["ended"] == "resume"
    assert json.loads(error_file.read_text())["message"]["message"] == "gpuwatch: stopped for resume (test)"


def test_close_is_idempotent(tmp_path: Path) -> None:
    link = TrainerLink(tmp_path, stop_signal=None)
    link.close()
    link.close()


def test_report_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="report_interval_s"):
        TrainerLink(tmp_path, report_interval_s=0)


def test_bench_step_returns_seconds_per_call() -> None:
    per_call = bench_step(1000)
    assert 0 < per_call < 1
