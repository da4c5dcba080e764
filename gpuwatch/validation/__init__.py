"""Active validation before a quarantined GPU goes back: a sacrificial test process, judged against references.

Passive burn-in on an idle card proves little (a card "healthy" at idle fails again under the first
job), so before an automatic release, on `gpuwatch release N --validate` and in the `validate` drill,
the GPU runs the test program (gpu_test.py: matmul throughput, memory bandwidth, a pattern
write/read-back) in its own process, plus `dcgmi diag -r 1` where DCGM is installed. It never runs on
a GPU with any process on it. The outcome names every figure and its reference.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpuwatch.config import Config
from gpuwatch.model import GpuStatic
from gpuwatch.validation.references import reference

log = logging.getLogger("gpuwatch.validation")

FAILED_RULE = "validation_failed"


@dataclass(frozen=True)
class ValidationResult:
    """`outcome`: passed | failed | refused (not run: the GPU has processes). `reason`: one line with the figures."""

    outcome: str
    reason: str
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


def validate(static: GpuStatic, pids: Sequence[int], config: Config) -> ValidationResult:
    """Run the GPU test on `static` (and dcgmi diag where installed) unless it has processes; judge the figures."""
    if pids:
        return ValidationResult("refused", f"not run: {len(pids)} process(es) on the GPU ({_pids(pids)})")
    cfg = config.validation
    command = shlex.split(cfg.program) if cfg.program else [sys.executable, "-m", "gpuwatch.validation.gpu_test"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": static.uuid or str(static.index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        done = subprocess.run(
            [*command, "--json"], env=env, capture_output=True, text=True, timeout=cfg.timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return ValidationResult("failed", f"GPU test did not finish within {cfg.timeout_s:g} s")
    except OSError as exc:
        return ValidationResult("failed", f"GPU test {command[0]} could not start: {exc.strerror or exc}")
    if done.returncode != 0:
        return ValidationResult("failed", f"GPU test exited {done.returncode}: {_last_line(done.stderr)}")
    try:
        raw = json.loads(done.stdout.strip().splitlines()[-1])
        figures = {k: float(raw[k]) for k in ("matmul_tflops", "mem_bandwidth_gbps", "pattern_errors")}
    except (IndexError, KeyError, TypeError, ValueError):
        return ValidationResult("failed", f"GPU test printed no figures: {_last_line(done.stdout)}")
    result = judge(static.name, figures, config)
    if result.passed and cfg.dcgm_diag:
        diag = _dcgm_diag(static, config)
        if diag is not None:
            return ValidationResult("failed", f"{result.reason}; {diag}", figures)
    return result


def judge(model: str, figures: dict[str, float], config: Config) -> ValidationResult:
    """Compare measured figures with the model's reference, each allowed `tolerance` below it."""
    cfg = config.validation
    ref = reference(model, cfg.matmul_tflops, cfg.mem_bandwidth_gbps)
    parts, failed = [], False
    for key, label, unit in (("matmul_tflops", "matmul", "TFLOPS"), ("mem_bandwidth_gbps", "memory bandwidth", "GB/s")):
        measured = figures[key]
        wanted = getattr(ref, key) if ref is not None else 0.0
        if not wanted:
            parts.append(f"{label} {measured:.0f} {unit} (no reference for {model or 'this model'})")
            continue
        floor = wanted * (1.0 - cfg.tolerance)
        low = measured < floor
        failed |= low
        parts.append(
            f"{label} {measured:.0f} {unit} {'below' if low else 'within'} reference {wanted:.0f} "
            f"(floor {floor:.0f} at {cfg.tolerance:.0%} tolerance)"
        )
    errors = int(figures["pattern_errors"])
    failed |= errors > 0
    parts.append(f"memory pattern {errors} mismatched word(s)")
    return ValidationResult("failed" if failed else "passed", "; ".join(parts), figures)


def _dcgm_diag(static: GpuStatic, config: Config) -> str | None:
    """None when `dcgmi diag -r 1` passed or DCGM is not installed; else why it failed."""
    dcgmi = shutil.which(config.tools.dcgmi)
    if dcgmi is None:
        return None
    command = [dcgmi, "diag", "-r", "1", "-i", str(static.index)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=config.validation.timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"dcgmi diag -r 1 did not run: {exc}"
    if done.returncode != 0:
        return f"dcgmi diag -r 1 failed (exit {done.returncode}): {_last_line(done.stdout + done.stderr)}"
    return None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _pids(pids: Sequence[int]) -> str:
    return ", ".join(str(p) for p in list(pids)[:8])
