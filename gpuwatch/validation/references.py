"""Reference figures per GPU model for the active validation (gpuwatch/validation/gpu_test.py measures them).

To add a model: run `python3 -m gpuwatch.validation.gpu_test --json` on a few healthy, idle cards of that
model, take the lowest of each figure, and add a line keyed by NVML's device name. A model without a
line is checked by its memory pattern only (and `[validation] matmul_tflops` / `mem_bandwidth_gbps`,
which override any line here, e.g. for one node's power cap).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reference:
    """What a healthy card of one model measures: dense bf16 matmul and device-memory copy bandwidth."""

    matmul_tflops: float
    mem_bandwidth_gbps: float


# NVML device name → figures, the lowest of what healthy, idle cards measured with gpu_test.
# NVIDIA H200 (driver 580, 2026-11-30, the lab's card): 768, 780 and 761 TFLOPS; 4260, 4264 and 4253 GB/s.
REFERENCES: dict[str, Reference] = {
    "NVIDIA H200": Reference(matmul_tflops=761.0, mem_bandwidth_gbps=4253.0),
}


def reference(model: str, matmul_tflops: float = 0.0, mem_bandwidth_gbps: float = 0.0) -> Reference | None:
    """The figures for `model`, each overridden where the override is non-zero; None when neither is known."""
    known = REFERENCES.get(model)
    matmul = matmul_tflops or (known.matmul_tflops if known else 0.0)
    bandwidth = mem_bandwidth_gbps or (known.mem_bandwidth_gbps if known else 0.0)
    if not matmul and not bandwidth:
        return None
    return Reference(matmul, bandwidth)
