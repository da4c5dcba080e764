"""Fixtures for the health tests: the trace recorded on a real, healthy H200."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpuwatch.model import SAMPLE_FIELDS, GpuSample, GpuStatic

REPO = Path(__file__).resolve().parents[2]
TRACE = "h200-healthy-workload.jsonl"


@pytest.fixture(scope="session")
def healthy_trace() -> tuple[GpuStatic, list[GpuSample]]:
    """GPU 0's static facts and samples from ../shared/traces (or the repo's copy; skipped when absent)."""
    candidates = [REPO.parent / "shared" / "traces", REPO / "shared" / "traces", REPO / "tests" / "data"]
    path = next((p / TRACE for p in candidates if (p / TRACE).is_file()), None)
    if path is None:
        pytest.skip(f"{TRACE} not found in ../shared/traces, shared/traces or tests/data")
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    known = {f.name for f in dataclasses.fields(GpuStatic)}
    static = GpuStatic(**{k: v for k, v in lines[0]["static"][0].items() if k in known})
    samples = []
    for line in lines[1:]:
        if line.get("index") == 0 and "event" not in line and "error" not in line:
            fields = {k: v for k, v in line.items() if k in SAMPLE_FIELDS}
            fields["pids"] = tuple(fields.get("pids") or ())
            samples.append(GpuSample(**fields))
    return static, samples
