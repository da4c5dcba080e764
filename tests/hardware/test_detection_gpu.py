"""Issue 14 on a real GPU (GPUWATCH_TEST_GPU=1, `-s` prints the figures): the new NVML readings, the kernel
log, and the GPU test against the model's reference (passing, and failing with the reference 30 % above
the card's own figure). Nothing here changes a GPU setting; the test runs only on a GPU with no process.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from gpuwatch.backends.kmsg import KernelLog
from gpuwatch.backends.nvml import NvmlBackend
from gpuwatch.config import Config, ValidationConfig
from gpuwatch.validation import validate

pytestmark = pytest.mark.gpu


def test_new_readings_are_silent_on_a_healthy_gpu() -> None:
    backend = NvmlBackend(Config())
    statics = backend.open()
    try:
        for static in statics:
            sample = backend.sample(static.index, time.time(), slow=True)
            print(
                static.name,
                static.pcie_link_gen_max,
                static.pcie_link_width_max,
                {
                    k: getattr(sample, k)
                    for k in (
                        "pcie_link_gen",
                        "pcie_link_width",
                        "pcie_correctable_errors",
                        "recovery_action",
                        "nvlink_links_down",
                        "nvlink_crc_errors",
                        "fabric_state",
                    )
                },
            )
            assert sample.recovery_action in (0, None)
            assert sample.pcie_link_width is not None and static.pcie_link_width_max is not None
    finally:
        backend.close()


def test_kernel_log_is_readable_and_maps_xids() -> None:
    backend = NvmlBackend(Config())
    statics = backend.open()
    backend.close()
    kernel_log = KernelLog(Config().tools.kmsg, statics)
    if not kernel_log.open():
        pytest.skip("kernel log not readable here")
    events = kernel_log.read_available()
    kernel_log.close()
    for event in events:
        print(time.strftime("%F %T", time.gmtime(event.t)), event.index, event.xid, event.detail)
    assert all(e.t <= time.time() + 1 for e in events)


@pytest.mark.skipif(not os.environ.get("GPUWATCH_TEST_GPU"), reason="needs a GPU")
def test_gpu_test_passes_and_fails_against_the_reference() -> None:
    pytest.importorskip("torch")
    backend = NvmlBackend(Config())
    statics = backend.open()
    try:
        static = statics[0]
        pids = backend.sample(0, time.time()).pids
    finally:
        backend.close()
    if pids:
        pytest.skip(f"GPU 0 has processes {pids}")
    config = Config()
    passed = validate(static, (), config)
    print("reference:", passed.outcome, passed.reason, passed.figures)
    assert passed.passed, passed.reason
    above = dataclasses.replace(
        ValidationConfig(), matmul_tflops=passed.figures["matmul_tflops"] * 1.3, dcgm_diag=False
    )
    failed = validate(static, (), dataclasses.replace(config, validation=above))
    print("reference +30 %:", failed.outcome, failed.reason)
    assert failed.outcome == "failed" and "below reference" in failed.reason
