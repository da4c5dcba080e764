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
from gpuwatch.bench.serving import tick_overlap


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
    # every part of the interference section, not only its default plan
    args += ["--interference-conditions", "all", "--interference-steps", "short,long"]
    args += ["--attribute-s", "0.4", "--event-set-s", "1"]
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
    growth = figures["sampling"]["growth"]
    assert {(c["gpus"], c["history_s"]) for c in growth} == {(g, h) for g in (1, 2) for h in (0.0, 600.0, 3600.0)}
    assert all(c["tick_per_gpu_us"] > 0 and 0 < c["bytes_per_gpu"] < 256 * 1024 for c in growth), growth
    assert [r["history_s"] for r in figures["sampling"]["rules_only"]] == [0.0, 600.0, 3600.0]
    assert figures["footprint"]["import_rss_mb"]["mission packages together"] > 0
    assert figures["trainer"]["step_us"]["median"] > 0
    assert figures["serving"]["gpuwatch"]["levels"]["10"]["p99_ms"] > 0
    assert figures["detection"]["injection"]["api_s_max"] >= 0
    assert figures["detection"]["kernel_log"]["api_s_max"] > 0
    assert figures["detection"]["sustained"]["flagged_s"] > 0
    assert figures["footprint"]["gpuwatch_1s"]["rss_mb"] > 0
    assert figures["footprint"]["gpuwatch_30s"]["cpu_s_per_hour"] >= 0
    _check_interference(figures["interference"], sections["interference"]["notes"])
    recovery = figures["recovery"]["sizes"]["16 MiB"]  # the quick size
    assert recovery["floor"]["write"] > 0 and recovery["floor"]["read"] > 0
    assert recovery["checkpoint"]["save_gib_s"] > 0 and recovery["checkpoint"]["load_gib_s"] > 0
    assert recovery["checkpoint"]["legacy"]["save_gib_s"] > 0
    assert recovery["snapshot"]["step_s"] > 0 and recovery["snapshot"]["every"] >= 1
    assert recovery["snapshot"]["rescue_s"] > 0
    paths = recovery["paths"]
    names = ("disk", "snapshot", "in_place", "spare", "cold_start")
    assert [paths[name]["source"] for name in names] == ["disk", "memory", "peers' memory", "memory", "memory"]
    assert paths["spare"]["spare_warm_s"] is not None and paths["cold_start"]["spare_warm_s"] is None
    for result in paths.values():
        assert result["fault_to_step_s"] > 0 and 0 <= result["steps_lost"] <= 4, result
    assert paths["in_place"]["steps_lost"] == 0


def _check_interference(figures: dict[str, Any], notes: list[str]) -> None:
    """The sim form: a CPU step loop beside the sim daemon at 1 s and 30 s, restarted around each of its
    segments, two rounds a step, the attribution; what needs NVML is left out with a note."""
    assert figures["device"] == "cpu" and figures["gpu_measured"] is False
    assert any("GPU side was not measured" in note for note in notes), notes
    assert any(note.startswith("event-set probe: needs NVML") for note in notes), notes
    assert figures["event_set"] is None and figures["settings"]["restart"] is True
    for kind in ("short", "long"):
        result = figures[kind]
        assert result["rounds"] == 2 and result["step_ms"] > 0
        conditions = result["conditions"]
        assert set(conditions) == {"alone", "gpuwatch_1s", "gpuwatch_30s"}
        for key in ("gpuwatch_1s", "gpuwatch_30s"):
            entry = conditions[key]
            assert entry["segments"] == 2 and entry["n"] > 0
            assert entry["p50_ms"] <= entry["p99_ms"] <= entry["max_ms"]
            assert entry["mean_vs_alone"]["pairs"] == 2 and entry["mean_vs_alone"]["low_pct"] is not None
        assert result["differences"] == {}  # neither pair of conditions ran on the sim backend
    ours = figures["monitors"]["gpuwatch_1s"]
    assert ours["starts"] == 1 + 2 * 2 and ours["died_in_segments"] == 0 and ours["scrapes"] > 0
    assert figures["bare"]["segments"] == 2
    attribution = figures["attribution"]
    assert attribution["calls"]["sample_sim"]["calls"] > 0
    assert set(attribution["daemons"]) == {"daemon:no_nvml", "daemon:serving"}
    assert attribution["daemons"]["daemon:serving"]["scrapes"] > attribution["daemons"]["daemon:no_nvml"]["scrapes"]


@pytest.mark.slow
def test_detection_times_an_xid_line_through_the_kernel_log_path_on_the_sim(tmp_path: Path) -> None:
    """The real path (a kmsg record to the log the daemon follows) is measured and printed, apart from injection."""
    out = tmp_path / "bench.json"
    args = ["--backend", "sim", "--gpus", "2", "--quick", "--only", "detection", "--json", str(out)]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    assert "XID 79 kernel-log line → finding in /v1/gpus/N" in result.output
    assert "XID 79 kernel-log line → finding in /metrics" in result.output
    detection = json.loads(out.read_text())["sections"]["detection"]["figures"]
    runs = detection["kernel_log"]["runs"]
    assert [r["gpu"] for r in runs] == [0, 1]
    assert all(0 < r["api_s"] <= r["metrics_s"] < 10 for r in runs), runs
    assert detection["nvml_events"] == "sim has no NVML"


@pytest.mark.parametrize("only", ["sampling,nope", ",", "Serving"])
def test_bad_only_is_one_line_and_exit_2(only: str) -> None:
    result = CliRunner().invoke(bench, ["--backend", "sim", "--only", only])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: error: --only:"), result.stderr
    assert "choose from sampling," in lines[0]


def test_tick_overlap_splits_requests_by_the_ticks_they_overlapped() -> None:
    """Snapshot 10.0 is the first body; a tick starts at 11.0 and its body first comes back at 11.5."""
    requests = [
        (10.10, 0.001, 10.0),
        (10.90, 0.200, 10.0),  # in flight when the tick at 11.0 began: overlapped, and slow
        (11.20, 0.010, 10.0),  # inside the tick
        (11.50, 0.001, 11.0),  # the first to get the new Snapshot ends the window
        (11.60, 0.001, 11.0),
        (11.70, 0.002, 11.0),
    ]
    found = tick_overlap(list(requests))
    assert found is not None
    assert (found["ticks"], found["during_n"]) == (1, 3)
    assert found["during_p99_ms"] == 200.0 and found["outside_p99_ms"] == 2.0
    assert found["tail_share"] == 1.0
    assert tick_overlap([(1.0, 0.001, None)]) is None  # a peer's body names no Snapshot
    assert tick_overlap([(1.0, 0.001, 5.0), (1.1, 0.001, 5.0)]) is None  # no tick during the run
