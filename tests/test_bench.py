"""`gpuwatch bench` keeps working: a quick sim run writes every section with numbers; bad --only is one line.

Nothing here asserts a speed: the figures depend on the machine, and the targets are informational.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatch.bench.cli import SECTIONS, bench


def _numbers(value: Any) -> list[float]:
    """Every number in a JSON value (bools are not figures)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


@pytest.mark.slow
def test_quick_sim_run_writes_every_section_with_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--backend", "sim", "--gpus", "2", "--quick", "--footprint-s", "3", "--json", str(out)]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["backend"] == "sim" and report["gpus"] == 2 and report["mode"] == "quick"
    assert report["date"] and report["machine"]["hostname"] and report["machine"]["cpu_count"]
    assert report["versions"]["gpuwatch"] and report["versions"]["python"]
    sections = report["sections"]
    assert list(sections) == list(SECTIONS)
    for name, section in sections.items():
        if section["status"] == "skipped":  # remediation, until `gpuwatch launch` exists
            assert name == "remediation" and section["reason"], section
            continue
        assert section["status"] == "ok", (name, section)
        assert len(_numbers(section["figures"])) > 1, (name, section)
        for row in section["targets"]:
            assert isinstance(row["value"], int | float), (name, row)
    figures = {name: section["figures"] for name, section in sections.items()}
    assert figures["sampling"]["full_sample_us"]["mean_us"] > 0
    assert figures["sampling"]["tick"]["1s"]["tick_per_gpu_us"] > 0
    assert figures["trainer"]["step_us"]["median"] > 0
    assert figures["serving"]["gpuwatch"]["levels"]["10"]["p99_ms"] > 0
    assert figures["detection"]["event"]["api_s_max"] >= 0
    assert figures["detection"]["sustained"]["flagged_s"] > 0
    assert figures["footprint"]["gpuwatch_1s"]["rss_mb"] > 0
    assert figures["footprint"]["gpuwatch_30s"]["cpu_s_per_hour"] >= 0


@pytest.mark.parametrize("only", ["sampling,nope", ",", "Serving"])
def test_bad_only_is_one_line_and_exit_2(only: str) -> None:
    result = CliRunner().invoke(bench, ["--backend", "sim", "--only", only])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: error: --only:"), result.stderr
    assert "choose from sampling," in lines[0]
