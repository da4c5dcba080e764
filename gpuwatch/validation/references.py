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


# NVML device name → figures. The H200 line is provisional (datasheet-derived: ~989 TFLOPS dense bf16
# peak, of which a 700 W-capped card sustains about two thirds; 4.8 TB/s HBM3e, of which a copy sustains
# ~80 %) until the project's measurement on the lab's H200 replaces it.
REFERENCES: dict[str, Reference] = {
    "NVIDIA H200": Reference(matmul_tflops=600.0, mem_bandwidth_gbps=3800.0),
}


def reference(model: str, matmul_tflops: float = 0.0, mem_bandwidth_gbps: float = 0.0) -> Reference | None:
    """The figures for `model`, each overridden where the override is non-zero; None when neither is known."""
    known = REFERENCES.get(model)
    matmul = matmul_tflops or (known.matmul_tflops if known else 0.0)
    bandwidth = mem_bandwidth_gbps or (known.mem_bandwidth_gbps if known else 0.0)
    if not matmul and not bandwidth:
        return None
    return Reference(matmul, bandwidth)
