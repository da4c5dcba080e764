"""The validate drill on the sim daemon: the fake GPU test passes (back in service) or fails (kept, with a finding)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from gpuwatch.drills.runner import DrillRefused, Request, prepare, run_drill
from gpuwatch.model import GpuSample
from gpuwatch.validation import validate
from tests.drills.conftest import ClientApi, sim_clock
from tests.helpers import SimNode

FAKE = Path(__file__).parents[1] / "fakes" / "fake_gpu_test.py"


def use_fake_test(node: SimNode, args: str) -> None:
    config = node.daemon.config
    program = f"{sys.executable} {FAKE} {args}"
    pinned = {"matmul_tflops": 600.0, "mem_bandwidth_gbps": 3800.0}  # not the measured model table
    cfg = config.__class__(validation=config.validation.__class__(program=program, dcgm_diag=False, **pinned))
    node.daemon.monitor.validator = lambda static, pids: validate(static, (), cfg)


def idle_gpu(node: SimNode, index: int = 1) -> int:
    """Every sim GPU runs a process; this one's job ended."""
    sample = node.daemon.backend.sample

    def without_processes(i: int, now: float, *, slow: bool = False) -> GpuSample:
        s = sample(i, now, slow=slow)
        return dataclasses.replace(s, pids=()) if i == index else s

    node.daemon.backend.sample = without_processes  # type: ignore[method-assign]
    node.daemon.monitor.tick()
    return index


def drill(node: SimNode, gpu: int) -> list[tuple[str, str]]:
    run = prepare(Request("validate", gpu), ClientApi(node), node.daemon.config, sim_clock(node))
    return [(r.name, r.result) for r in run_drill(run).steps]


def test_an_idle_gpu_that_passes_goes_back_into_service(node: SimNode) -> None:
    idle = idle_gpu(node)
    use_fake_test(node, "--tflops 640")
    assert drill(node, idle) == [("quarantine", "pass"), ("no_processes", "pass"), ("validate", "pass")]
    assert node.gpu(idle)["quarantined"] is False


def test_a_gpu_that_fails_stays_quarantined_with_the_figures(node: SimNode) -> None:
    idle = idle_gpu(node)
    use_fake_test(node, "--tflops 300")
    assert drill(node, idle)[-1] == ("validate", "fail")
    gpu = node.gpu(idle)
    assert gpu["quarantined"] is True
    failed = [f for f in gpu["findings"] if f["rule"] == "validation_failed"]
    assert failed and "matmul 300 TFLOPS below reference 600" in failed[0]["reason"]


def test_a_busy_gpu_is_refused(node: SimNode) -> None:
    busy = next(g["index"] for g in node.client.get("/v1/gpus").json()["gpus"] if g["sample"]["pids"])
    with pytest.raises(DrillRefused, match="has processes"):
        prepare(Request("validate", busy), ClientApi(node), node.daemon.config, sim_clock(node))


def test_validate_can_be_scheduled_on_idle_gpus() -> None:
    from gpuwatch.config import DrillSchedule
    from gpuwatch.drills.scheduler import validate as check_schedule

    check_schedule(DrillSchedule(cron="0 3 * * sun", drill="validate", gpu="idle"), "drills.schedule[0]")
