"""Active validation before release: the gate over a fake GPU test (pass and fail), and the monitor's use of it."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest

from gpuwatch.backends.sim import SimBackend
from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config, ValidationConfig
from gpuwatch.model import GpuSample, GpuStatic
from gpuwatch.node.monitor import Monitor
from gpuwatch.node.store import Store
from gpuwatch.validation import ValidationResult, judge, validate
from tests.helpers import T0, sim_config

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "fake_gpu_test.py"
H200 = GpuStatic(index=3, uuid="GPU-3", name="NVIDIA H200")


def config(args: str = "", **validation: object) -> Config:
    """The fake GPU test with `args`; the references are pinned here, not taken from the measured model table."""
    validation = {"matmul_tflops": 600.0, "mem_bandwidth_gbps": 3800.0, **validation}
    program = f"{sys.executable} {FAKE} {args}"
    return Config(validation=dataclasses.replace(ValidationConfig(), program=program, dcgm_diag=False, **validation))


def test_a_healthy_card_passes_with_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tmp_path / "seen"
    monkeypatch.setenv("FAKE_GPU_TEST_SEEN", str(seen))
    result = validate(H200, (), config("--tflops 612 --bandwidth 4010"))
    assert result.passed, result.reason
    assert "matmul 612 TFLOPS within reference 600" in result.reason
    assert "memory bandwidth 4010 GB/s within reference 3800" in result.reason
    assert seen.read_text() == "GPU-3"  # the test ran on that GPU only


def test_a_slow_card_fails_naming_the_figure_and_the_reference() -> None:
    result = validate(H200, (), config("--tflops 400"))
    assert result.outcome == "failed"
    assert "matmul 400 TFLOPS below reference 600 (floor 510 at 15% tolerance)" in result.reason


def test_reference_set_30_percent_above_the_card_fails() -> None:
    """What the H200 check does with a real card: its own figure × 1.3 as the reference."""
    assert not validate(H200, (), config("--tflops 612", matmul_tflops=612 * 1.3)).passed
    assert validate(H200, (), config("--tflops 612", matmul_tflops=612.0)).passed


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ("--errors 3", "memory pattern 3 mismatched word(s)"),
        ("--exit 1", "GPU test exited 1: CUDA error: an illegal memory access"),
        ("--bandwidth 1000", "memory bandwidth 1000 GB/s below reference 3800"),
    ],
)
def test_failures(args: str, why: str) -> None:
    result = validate(H200, (), config(args))
    assert result.outcome == "failed" and why in result.reason


def test_never_runs_on_a_gpu_with_a_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tmp_path / "seen"
    monkeypatch.setenv("FAKE_GPU_TEST_SEEN", str(seen))
    result = validate(H200, (4242,), config())
    assert result.outcome == "refused" and "4242" in result.reason
    assert not seen.exists()


def test_a_missing_program_or_no_figures_fails() -> None:
    assert validate(H200, (), Config(validation=ValidationConfig(program="/nonexistent/gpu-test"))).outcome == "failed"
    echo = Config(validation=ValidationConfig(program="echo hello", dcgm_diag=False))
    assert "printed no figures" in validate(H200, (), echo).reason


def test_a_model_without_reference_is_judged_by_its_pattern_only() -> None:
    figures = {"matmul_tflops": 1.0, "mem_bandwidth_gbps": 1.0, "pattern_errors": 0.0}
    result = judge("NVIDIA Z9", figures, Config())
    assert result.passed and "no reference for NVIDIA Z9" in result.reason


# -- the monitor: automatic release waits for the test; a failure keeps the quarantine ------------------------


class Scripted(SimBackend):
    """The sim, with sample fields of one GPU overridden while a test says so."""

    fault: dict[int, dict[str, object]] = {}

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        return dataclasses.replace(super().sample(index, now, slow=slow), **self.fault.get(index, {}))  # type: ignore[arg-type]


def node(tmp_path: Path, store: Store | None = None, **overrides: object) -> tuple[Monitor, Scripted, ManualClock]:
    cfg = sim_config(
        tmp_path,
        gpus=2,
        **{"policy.recovery_s": 10.0, "policy.burn_in_s": 30.0, "policy.breaker_window_s": 20.0, **overrides},  # type: ignore[arg-type]
    )
    clock = ManualClock(T0)
    backend = Scripted(cfg, clock=clock)
    backend.fault = {}
    return Monitor(backend, backend.open(), cfg, store=store, clock=clock), backend, clock


def run(monitor: Monitor, clock: ManualClock, seconds: float) -> None:
    for _ in range(int(seconds / 5)):
        clock.advance(5)
        monitor.tick()
        for thread in threading.enumerate():
            if thread.name.startswith("gpuwatch-validate-"):
                thread.join(10)


def quarantine_and_recover(monitor: Monitor, backend: Scripted, clock: ManualClock) -> None:
    backend.fault = {1: {"remapped_pending": 1}}
    run(monitor, clock, 10)
    assert monitor.snapshot.gpu(1).quarantined  # type: ignore[union-attr]
    backend.fault = {}


def test_automatic_release_waits_for_a_passed_test(tmp_path: Path) -> None:
    monitor, backend, clock = node(tmp_path)
    calls: list[tuple[str, tuple[int, ...]]] = []

    def passing(static: GpuStatic, pids: object) -> ValidationResult:
        calls.append((static.uuid, tuple(pids)))  # type: ignore[arg-type]
        return ValidationResult("passed", "matmul 612 TFLOPS within reference 600")

    monitor.validator = passing
    quarantine_and_recover(monitor, backend, clock)
    run(monitor, clock, 60)
    gpu = monitor.snapshot.gpu(1)
    assert gpu is not None and not gpu.quarantined
    assert [uuid for uuid, _ in calls] == [gpu.uuid]  # once, on that GPU


def test_a_failed_test_keeps_the_quarantine_with_a_finding(tmp_path: Path) -> None:
    monitor, backend, clock = node(tmp_path)
    monitor.validator = lambda static, pids: validate(static, (), config("--tflops 400"))
    quarantine_and_recover(monitor, backend, clock)
    run(monitor, clock, 300)
    gpu = monitor.snapshot.gpu(1)
    assert gpu is not None and gpu.quarantined and gpu.state.value == "degraded"
    (failed,) = [f for f in gpu.findings if f.rule == "validation_failed"]
    assert "matmul 400 TFLOPS below reference 600" in failed.reason and failed.action.value == "hardware_inspection"
    monitor.release(1, "replaced the riser")  # the operator's call drops the held finding
    assert not monitor.snapshot.gpu(1).quarantined  # type: ignore[union-attr]
    assert "validation_failed" not in {f.rule for f in monitor.snapshot.gpu(1).findings}  # type: ignore[union-attr]


def test_release_validate_for_the_operator(tmp_path: Path) -> None:
    monitor, _, clock = node(tmp_path)
    run(monitor, clock, 5)
    monitor.quarantine(1, "suspect")
    monitor.validator = lambda static, pids: validate(static, (), config("--errors 2"))
    status, result = monitor.release_validated(1)
    assert status.quarantined and result.outcome == "failed"
    monitor.validator = lambda static, pids: validate(static, (), config())
    status, result = monitor.release_validated(1)
    assert result.passed and not status.quarantined


# -- repeat offenders ------------------------------------------------------------------------------------------


def test_repeat_offender_is_escalated_and_held_across_a_restart(tmp_path: Path) -> None:
    store = Store(tmp_path / "state" / "gpuwatch.db")
    monitor, backend, clock = node(tmp_path, store, **{"policy.repeat_quarantines": 2})
    quarantine_and_recover(monitor, backend, clock)
    run(monitor, clock, 60)  # burn-in releases the first one (no validator on the sim)
    assert not monitor.snapshot.gpu(1).quarantined  # type: ignore[union-attr]
    store.close()

    store = Store(tmp_path / "state" / "gpuwatch.db")  # the daemon restarts: the count is in SQLite
    monitor, backend, restarted = node(tmp_path, store, **{"policy.repeat_quarantines": 2})
    restarted.t = clock.t
    quarantine_and_recover(monitor, backend, restarted)
    gpu = monitor.snapshot.gpu(1)
    assert gpu is not None and gpu.quarantine_reason.startswith("repeat offender: quarantined automatically 2 times")
    assert "repeat_offender" in {f.rule for f in gpu.findings}
    assert gpu.suggested_action.value in {"reset_gpu", "hardware_inspection"}
    run(monitor, restarted, 600)  # clean for far longer than burn-in: still held
    assert monitor.snapshot.gpu(1).quarantined  # type: ignore[union-attr]
    store.close()

    store = Store(tmp_path / "state" / "gpuwatch.db")  # and across another restart
    monitor, _, again = node(tmp_path, store, **{"policy.repeat_quarantines": 2})
    again.t = restarted.t
    run(monitor, again, 60)
    gpu = monitor.snapshot.gpu(1)
    assert gpu is not None and gpu.quarantined and "repeat_offender" in {f.rule for f in gpu.findings}
    monitor.release(1, "card replaced")
    assert not monitor.snapshot.gpu(1).quarantined  # type: ignore[union-attr]
    store.close()


def test_quarantines_spread_beyond_the_window_are_no_repeat(tmp_path: Path) -> None:
    store = Store(tmp_path / "state" / "gpuwatch.db")
    monitor, backend, clock = node(tmp_path, store, **{"policy.repeat_quarantines": 2, "policy.repeat_window_s": 60.0})
    quarantine_and_recover(monitor, backend, clock)
    run(monitor, clock, 120)
    quarantine_and_recover(monitor, backend, clock)
    gpu = monitor.snapshot.gpu(1)
    assert gpu is not None and not gpu.quarantine_reason.startswith("repeat offender")
    store.close()


def test_api_release_validate(tmp_path: Path) -> None:
    from tests.helpers import start_sim_node

    sim = start_sim_node(tmp_path, gpus=2)
    try:
        url = "/v1/gpus/1/release"
        assert sim.client.post("/v1/gpus/1/quarantine", json={"reason": "suspect"}, headers=sim.auth).status_code == 200
        refused = sim.client.post(url, json={"validate": True}, headers=sim.auth)
        assert refused.status_code == 409 and "no GPU test on this backend" in refused.json()["detail"]
        sim.daemon.monitor.validator = lambda static, pids: validate(static, (), config("--tflops 100"))
        failed = sim.client.post(url, json={"validate": True}, headers=sim.auth)
        assert failed.status_code == 409 and "matmul 100 TFLOPS below reference 600" in failed.json()["detail"]
        assert sim.gpu(1)["quarantined"] is True
        sim.daemon.monitor.validator = lambda static, pids: validate(static, (), config())
        passed = sim.client.post(url, json={"validate": True, "reason": "checked"}, headers=sim.auth)
        assert passed.status_code == 200, passed.text
        assert passed.json()["quarantined"] is False and passed.json()["validation"]["outcome"] == "passed"
        assert sim.client.post(url, json={"validate": "maybe"}, headers=sim.auth).status_code == 422
    finally:
        sim.close()


@pytest.mark.slow
def test_the_real_gpu_test_without_a_gpu_fails_in_one_line() -> None:
    """The default program (python3 -m gpuwatch.validation.gpu_test) on a machine with no CUDA device."""
    result = validate(H200, (), Config(validation=ValidationConfig(dcgm_diag=False)))
    assert result.outcome == "failed"
    assert "GPU test exited" in result.reason and ("no CUDA device" in result.reason or "torch" in result.reason)


def test_cli_release_validate_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from gpuwatch.cli import main
    from gpuwatch.errors import DaemonError
    from gpuwatch.serving.client import DaemonClient
    from gpuwatch.serving.wire import GpuChanged

    asked: list[float | None] = []

    def refuse(
        self: DaemonClient, index: int, reason: str, force: bool = False, validate_timeout_s: float | None = None
    ) -> GpuChanged:
        asked.append(validate_timeout_s)
        raise DaemonError(f"POST /v1/gpus/{index}/release: HTTP 409: GPU {index} stays quarantined: validation failed")

    monkeypatch.setattr(DaemonClient, "release", refuse)
    args = ["release", "1", "--validate", "--state-dir", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "stays quarantined: validation failed" in result.output
    assert asked == [180.0 * 2 + 30]  # waits for the GPU test and dcgmi diag

    def accept(
        self: DaemonClient, index: int, reason: str, force: bool = False, validate_timeout_s: float | None = None
    ) -> GpuChanged:
        validation = {"outcome": "passed", "reason": "matmul 612 TFLOPS within reference 600"}
        return GpuChanged.model_validate(
            {"index": index, "uuid": "GPU-1", "state": "healthy", "validation": validation}
        )

    monkeypatch.setattr(DaemonClient, "release", accept)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "validation passed: matmul 612 TFLOPS" in result.output
