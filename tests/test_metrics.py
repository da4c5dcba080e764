"""/metrics: a golden file from a fixed sim scenario, promtool's lint, and the render cache."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import metric_samples, start_sim_node

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"
# Values move with the simulated load; the golden file pins names, types, help and label sets.
_VALUE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (.+)$")


def normalise(text: str) -> str:
    lines = []
    for line in text.splitlines():
        match = _VALUE.match(line)
        lines.append(f"{match.group(1)} <value>" if match and not line.startswith("#") else line)
    return "\n".join(lines) + "\n"


def demo_metrics(tmp_path: Path) -> str:
    node = start_sim_node(tmp_path, "demo", gpus=8)
    try:
        node.run_for(120)
        return node.client.get("/metrics").text
    finally:
        node.close()


def test_metrics_match_golden_file(tmp_path: Path) -> None:
    text = normalise(demo_metrics(tmp_path))
    if os.environ.get("GPUWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "metrics changed: rerun with GPUWATCH_UPDATE_GOLDEN=1 and review the diff"


def test_required_metrics_exist(tmp_path: Path) -> None:
    text = demo_metrics(tmp_path)
    for name in (
        "gpuwatch_gpu_info",
        "gpuwatch_gpu_health_state",
        "gpuwatch_gpu_quarantined",
        "gpuwatch_gpu_sm_clock_hertz",
        "gpuwatch_gpu_memory_clock_hertz",
        "gpuwatch_gpu_power_watts",
        "gpuwatch_gpu_temperature_celsius",
        "gpuwatch_gpu_ecc_errors_total",
        "gpuwatch_gpu_clocks_event_active",
        "gpuwatch_sample_duration_seconds",
    ):
        assert metric_samples(text, name), name
    sm = {labels["gpu"]: value for labels, value in metric_samples(text, "gpuwatch_gpu_sm_clock_hertz")}
    assert 300e6 < sm["3"] < 800e6, "GPU 3's collapsed SM clock, in hertz"
    reasons = {
        labels["reason"]
        for labels, value in metric_samples(text, "gpuwatch_gpu_clocks_event_active")
        if labels["gpu"] == "3" and value == 1
    }
    assert "hw_slowdown" in reasons


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_check_metrics_is_clean(tmp_path: Path) -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=demo_metrics(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "" and result.stderr.strip() == "", (
        result.stdout + result.stderr
    )


def test_render_is_cached_until_the_snapshot_changes(tmp_path: Path) -> None:
    node = start_sim_node(tmp_path, "healthy", gpus=2)
    try:
        first = node.daemon.renderer.render()
        assert node.daemon.renderer.render() is first
        node.run_for(5)
        assert node.daemon.renderer.render() is not first
    finally:
        node.close()


def test_fast_path_serves_the_rendered_bytes_and_passes_the_rest_on(tmp_path: Path) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST

    node = start_sim_node(tmp_path, "healthy", gpus=2)
    try:
        with node.client as client:
            response = client.get("/metrics")
            assert response.status_code == 200
            assert response.headers["content-type"] == CONTENT_TYPE_LATEST
            assert response.content == node.daemon.renderer.render()
            assert client.head("/metrics").content == b""
            assert client.get("/v1/gpus/1").json()["index"] == 1
            assert client.post("/metrics").status_code == 405
    finally:
        node.close()
