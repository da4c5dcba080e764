"""TrainerLink: its reports over the daemon's socket, its step page, stop requests by signal and by status.json."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.trainer import EXIT_RESUME, TrainerLink, bench_step
from gpuwatch.trainer.contract import STEP_PAGE_BYTES, read_step_page

CONTRACT_FIELDS = {
    "t", "pid", "rank", "local_rank", "world_size", "local_world_size", "job_id", "gpu_uuid", "step", "step_t",
    "first_step_t", "recovery", "uid",
    "step_time_s", "grad_norm", "grad_norm_var", "reserved_bytes", "allocated_bytes", "inactive_split_bytes",
    "num_alloc_retries", "num_ooms", "stop_requested", "first_step", "allow_drills", "spare", "spare_stage", "ended",
    "step_time_p99_s", "pause", "pause_until",
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


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[RuntimeDir]:
    """The daemon's side of the link in `tmp_path`: the report socket and what it received."""
    rt = RuntimeDir(tmp_path)
    rt.prepare()
    yield rt
    rt.close()


def _read_report(rt: RuntimeDir) -> dict[str, object] | None:
    """This process's report as the daemon holds it, under the contract's names."""
    report = rt.read_report(os.getpid())
    if report is None:
        return None
    fields = dataclasses.asdict(report.info)
    fields["t"] = fields.pop("updated_t")
    return fields


def _write_status(runtime_dir: Path, quarantined: dict[str, bool]) -> None:
    gpus: list[dict[str, object]] = [
        {"index": i, "uuid": uuid, "state": "unhealthy" if q else "healthy", "quarantined": q, "epoch": int(q),
         "findings": []}
        for i, (uuid, q) in enumerate(quarantined.items())
    ]  # fmt: skip
    tmp = runtime_dir / "status.json.tmp"
    tmp.write_text(json.dumps({"t": time.time(), "gpus": gpus}))
    os.replace(tmp, runtime_dir / "status.json")


def test_report_has_the_contract_fields(tmp_path: Path, runtime: RuntimeDir) -> None:
    with TrainerLink(tmp_path, report_interval_s=FAST, stop_signal=None) as link:
        for step, grad_norm in enumerate([1.0, 2.0, 3.0, float("nan")], start=1):
            link.step(step, loss=0.5, grad_norm=grad_norm)
        after = time.time()
        _wait_for(lambda: float((_read_report(runtime) or {}).get("t") or 0.0) >= after)  # type: ignore[arg-type]
        report = _read_report(runtime)
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
    assert report["recovery"] == "relaunch"  # gpuwatch.inplace.InPlaceJob sets "in_place"
    final = _read_report(runtime)  # left on close, for the daemon to read and remove
    assert final is not None and (final["ended"], final["step"], final["first_step"]) == ("finished", 4, 1)


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


def test_stop_signal_sets_stop_requested(tmp_path: Path, runtime: RuntimeDir, restore_sigusr1: None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    with TrainerLink(tmp_path, report_interval_s=FAST) as link:
        assert not link.stop_requested
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait_for(lambda: link.stop_requested)
        assert link.stop_reason == "signal SIGUSR1"
        _wait_for(lambda: (_read_report(runtime) or {}).get("stop_requested") is True)
    # Not put back to the default, which would end the process if a late stop request comes in its epilogue.
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


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
    warnings = [r for r in caplog.records if "cannot reach" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warnings) == 1  # said once, not every interval


def test_exit_for_resume(tmp_path: Path, runtime: RuntimeDir, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    link = TrainerLink(tmp_path, report_interval_s=FAST, stop_signal=None)
    _wait_for(lambda: _read_report(runtime) is not None)
    link.request_stop("test")

    with pytest.raises(SystemExit) as excinfo:
        link.exit_for_resume()

    assert excinfo.value.code == EXIT_RESUME == 75
    assert (_read_report(runtime) or {})["ended"] == "resume"
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


# -- issue 16: the first report at once; the final report with `ended`; safe temp files ----------


def test_the_first_step_is_reported_at_once_not_after_the_interval(tmp_path: Path, runtime: RuntimeDir) -> None:
    with TrainerLink(tmp_path, report_interval_s=3600, stop_signal=None) as link:
        _wait_for(lambda: _read_report(runtime) is not None)  # the start-up report, step null
        assert (_read_report(runtime) or {})["step"] is None
        started = time.monotonic()
        link.step(41)  # a relaunch resumed from step 40
        _wait_for(lambda: (_read_report(runtime) or {}).get("step") == 41, timeout=2)
        assert time.monotonic() - started < 1
        link.step(42)
        time.sleep(0.2)
        assert (_read_report(runtime) or {})["step"] == 42  # the step page has every step at once
    assert (_read_report(runtime) or {})["first_step"] == 41


@pytest.mark.parametrize(
    ("exit_with", "ended"),
    [(None, "finished"), (SystemExit(0), "finished"), (ValueError("bug"), "error"), (KeyboardInterrupt(), "error")],
)
def test_leaving_the_block_leaves_a_final_report_saying_how(
    tmp_path: Path, runtime: RuntimeDir, exit_with: BaseException | None, ended: str
) -> None:
    with pytest.raises(type(exit_with)) if exit_with is not None else contextlib.nullcontext():
        with TrainerLink(tmp_path, report_interval_s=3600, stop_signal=None) as link:
            link.step(1)
            if exit_with is not None:
                raise exit_with
    final = _read_report(runtime)
    assert final is not None and (final["ended"], final["step"]) == (ended, 1)


def test_the_step_page_holds_the_last_step_after_the_last_report(tmp_path: Path, runtime: RuntimeDir) -> None:
    """Reports go out every interval; the page is rewritten at every step, so the daemon's figure is exact."""
    with TrainerLink(tmp_path, report_interval_s=3600, stop_signal=None) as link:
        link.step(1)
        _wait_for(lambda: (_read_report(runtime) or {}).get("first_step") == 1)
        for step in range(2, 229):
            link.step(step)
        report = _read_report(runtime)
        assert report is not None and report["step"] == 228 and report["first_step"] == 1
        assert abs(float(report["step_t"]) - time.time()) < 5  # type: ignore[arg-type]


def test_under_launch_the_step_page_is_a_file_in_the_launch_dir(
    tmp_path: Path, runtime: RuntimeDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir(mode=0o700)
    monkeypatch.setenv("GPUWATCH_LAUNCH_DIR", str(launch_dir))
    with TrainerLink(tmp_path, report_interval_s=3600, stop_signal=None) as link:
        link.step(7)
        link.step(8)
    page = read_step_page((launch_dir / f"{os.getpid()}.step").read_bytes())
    assert page is not None and (page.step, page.first_step) == (8, 7)
    assert (launch_dir / f"{os.getpid()}.step").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("trap", ["group_writable_dir", "symlink_planted"])
def test_an_unsafe_launch_dir_is_not_written_and_the_link_still_reports(
    tmp_path: Path, runtime: RuntimeDir, monkeypatch: pytest.MonkeyPatch, trap: str
) -> None:
    launch_dir = tmp_path / "launch"
    launch_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if trap == "group_writable_dir":
        launch_dir.chmod(0o770)
    else:
        (launch_dir / f"{os.getpid()}.step").symlink_to(victim)
    monkeypatch.setenv("GPUWATCH_LAUNCH_DIR", str(launch_dir))
    with TrainerLink(tmp_path, report_interval_s=3600, stop_signal=None) as link:
        link.step(3)
        report = _read_report(runtime)
        _wait_for(lambda: (_read_report(runtime) or {}).get("step") == 3)
    assert victim.read_text() == "precious"
    assert report is None or report["pid"] == os.getpid()


def test_allow_drills_is_reported(tmp_path: Path, restore_sigusr2: None) -> None:
    with TrainerLink(tmp_path, stop_signal=None, allow_drills=True) as link:
        assert link.report()["allow_drills"] is True


# -- signals while the main thread is stuck; SIGTERM --------------------------------------------


def test_a_stop_signal_is_reported_at_once_by_the_thread(
    tmp_path: Path, runtime: RuntimeDir, restore_sigusr1: None
) -> None:
    """The wakeup fd wakes the thread, which writes the report long before the interval (the main thread
    waits meanwhile; test_rescue_gloo.py has one blocked in a real collective)."""
    with TrainerLink(tmp_path, report_interval_s=3600) as link:
        link.step(1)
        _wait_for(lambda: (_read_report(runtime) or {}).get("step") == 1)
        blocker = threading.Lock()
        blocker.acquire()
        threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        seen: list[object] = []
        threading.Timer(1.0, lambda: (seen.append(_read_report(runtime)), blocker.release())).start()
        # A lock acquire with a timeout of -1 only returns to bytecode when released (PEP 475 retries it).
        blocker.acquire()
        assert seen and seen[0]["stop_requested"] is True  # type: ignore[index]
        assert link.stop_requested


def test_sigterm_is_a_stop_request_and_a_loop_that_goes_on_is_ended_by_it(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys, time\n"
        "from gpuwatch.trainer import TrainerLink\n"
        f"with TrainerLink({str(tmp_path)!r}, report_interval_s=0.05) as link:\n"
        "    link.step(1)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    print(link.stop_requested, link.stop_reason, flush=True)\n"
        "    link.step(2)\n"
        "    print('not reached', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)

    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout == "True signal SIGTERM\n"
    assert "SIGTERM arrived and the loop went on: ending by SIGTERM" in result.stderr


def test_term_signal_none_leaves_sigterm_alone(tmp_path: Path) -> None:
    with TrainerLink(tmp_path, term_signal=None):
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# -- rescue ---------------------------------------------------------------------------------------


class Saves(list[int]):
    def __call__(self, step: int) -> None:
        self.append(step)


def test_rescue_saves_the_last_completed_step_after_a_collective_error_and_exits_75(
    tmp_path: Path, runtime: RuntimeDir
) -> None:
    saves = Saves()
    with pytest.raises(SystemExit) as exited, TrainerLink(tmp_path, stop_signal=None) as link:
        for step in range(1, 4):
            with link.rescue(saves):
                if step == 3:
                    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
            link.step(step)

    assert exited.value.code == EXIT_RESUME
    assert saves == [2]
    assert (_read_report(runtime) or {})["ended"] == "resume"


@pytest.mark.parametrize(
    ("error", "stop"),
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),  # own fault: state may be bad
        (ValueError("a bug in the loop"), False),  # not a collective: not ours to rescue
    ],
)
def test_rescue_leaves_a_cuda_fault_or_a_plain_bug_alone(tmp_path: Path, error: Exception, stop: bool) -> None:
    saves = Saves()
    with TrainerLink(tmp_path, stop_signal=None) as link:
        link.step(1)
        if stop:
            link.request_stop("test")
        with pytest.raises(type(error)), link.rescue(saves):
            raise error
    assert saves == []


def test_rescue_without_a_save_gets_out_but_propagates(tmp_path: Path) -> None:
    with TrainerLink(tmp_path, stop_signal=None) as link:
        link.step(1)
        with pytest.raises(RuntimeError, match="gloo"), link.rescue(None):
            raise RuntimeError("gloo: Connection reset by peer")


def test_a_pending_stop_aborts_a_stuck_step_and_the_step_does_not_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No process group here: the abort is only logged; the block that outlived it is still rescued."""
    saves = Saves()
    with pytest.raises(SystemExit) as exited, TrainerLink(tmp_path, stop_signal=None, abort_after_s=0.2) as link:
        link.step(7)
        with link.rescue(saves):
            link.request_stop("test")
            _wait_for(lambda: "aborting the process group" in caplog.text, timeout=3)
    assert exited.value.code == EXIT_RESUME
    assert saves == [7]


@pytest.mark.slow
def test_nccl_is_aborted_from_the_thread_and_gloo_is_said_to_be_unabortable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    aborted: list[str] = []
    c10d = types.SimpleNamespace(_abort_process_group=lambda: aborted.append(threading.current_thread().name))
    dist = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, get_backend=lambda: "nccl", distributed_c10d=c10d
    )
    cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(distributed=dist, cuda=cuda, __version__="x"))
    for backend, expected in (("nccl", ["gpuwatch-trainer-link"]), ("gloo", [])):
        aborted.clear()
        dist.get_backend = lambda backend=backend: backend  # type: ignore[misc]
        with pytest.raises(SystemExit), TrainerLink(tmp_path, stop_signal=None, abort_after_s=0.1) as link:
            with link.rescue(lambda step: None):
                link.request_stop("test")
                _wait_for(lambda: "aborting the process group" in caplog.text, timeout=3)
                time.sleep(0.1)
        assert aborted == expected, backend
        caplog.clear() if backend == "nccl" else None
    assert "gloo process groups cannot be aborted" in caplog.text


# -- the fault-rank drill -------------------------------------------------------------------------


@pytest.fixture
def restore_sigusr2() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, previous)


def test_the_fault_drill_stores_to_an_unmapped_address_on_our_own_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_sigusr2: None
) -> None:
    """No GPU here: a fake torch with CUDA up, and a fake store; the real one runs on the H200 (see README)."""
    stores: list[int | None] = []

    def fake_store(address: int = 0, device: int | None = None) -> Callable[[], object]:
        stores.append(device)

        def synchronize() -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return synchronize

    cuda = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 2, is_initialized=lambda: True, current_device=lambda: 0,
        get_device_properties=lambda device: types.SimpleNamespace(uuid=f"fake-{device}"),
        memory_stats=lambda device: {},
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr("gpuwatch.trainer.xid.torch_store", fake_store)
    with TrainerLink(tmp_path, report_interval_s=FAST, allow_drills=True):
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for(lambda: stores)
    assert stores == [1]  # LOCAL_RANK 1: cuda:1


def test_the_fault_drill_without_cuda_says_so_and_does_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, restore_sigusr2: None
) -> None:
    with TrainerLink(tmp_path, report_interval_s=FAST, allow_drills=True):
        os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for(lambda: "fault drill" in caplog.text)
    assert [r.getMessage() for r in caplog.records if "fault drill" in r.getMessage()] == [
        "fault drill: rank 5 has no CUDA context in this process: nothing done"
    ]


def test_without_allow_drills_the_drill_signal_is_not_handled(tmp_path: Path, restore_sigusr2: None) -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    with TrainerLink(tmp_path):
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN


def test_sigterm_aborts_a_stuck_step_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """torchrun's teardown (a peer failed) or the daemon's grace period: no step boundary is worth waiting for."""
    saves = Saves()
    with pytest.raises(SystemExit) as exited, TrainerLink(tmp_path, abort_after_s=60) as link:
        link.step(3)
        with link.rescue(saves):
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for(lambda: "aborting the process group" in caplog.text, timeout=1)
    assert exited.value.code == EXIT_RESUME
    assert saves == [3]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_forked_child_does_not_pass_its_signals_to_the_rank(tmp_path: Path, restore_sigusr1: None) -> None:
    """A DataLoader worker is forked with our handlers and wakeup fd: its SIGTERM must not stop the rank."""
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    with TrainerLink(tmp_path, report_interval_s=FAST) as link:
        pid = os.fork()
        if pid == 0:  # the child: handlers back to what they were, then die of SIGTERM as before the link
            restored = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1
            if restored:
                os.kill(os.getpid(), signal.SIGTERM)
            os._exit(9)
        _, status = os.waitpid(pid, 0)
        time.sleep(10 * FAST)
        assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM
        assert not link.stop_requested


def test_a_step_entered_after_the_stop_is_timed_from_its_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread sleeps a whole report interval otherwise: with a stop pending it looks for a block often."""
    saves = Saves()
    with pytest.raises(SystemExit), TrainerLink(tmp_path, 3600, stop_signal=None, abort_after_s=0.2) as link:
        link.step(4)
        link.request_stop("test")
        time.sleep(0.3)  # between steps: nothing to abort
        assert "aborting" not in caplog.text
        entered = time.monotonic()
        with link.rescue(saves):
            _wait_for(lambda: "aborting the process group" in caplog.text, timeout=2)
            assert 0.2 <= time.monotonic() - entered < 1.0
    assert saves == [4]


def test_pause_is_on_the_step_page_at_once_and_its_end_after(tmp_path: Path) -> None:
    """The daemon reads a declared pause from the page (no report needed), and when it ended."""
    with TrainerLink(tmp_path, report_interval_s=3600.0, stop_signal=None, gpu_uuid="GPU-x") as link:
        link.step(1)
        fd = link._page.fd
        assert fd is not None
        before = time.time()
        with link.pause("checkpoint", up_to_s=30.0):
            page = read_step_page(os.pread(fd, STEP_PAGE_BYTES, 0))
            assert page is not None and page.pause_until is not None
            assert before + 30.0 <= page.pause_until <= time.time() + 30.0
            assert (link.report()["pause"], link.report()["pause_until"]) == ("checkpoint", page.pause_until)
        page = read_step_page(os.pread(fd, STEP_PAGE_BYTES, 0))
        assert page is not None and page.pause_until is not None and before <= page.pause_until <= time.time()
        assert link.report()["pause"] is None
        with pytest.raises(ValueError, match="up_to_s"), link.pause("eval", up_to_s=float("inf")):
            pass
