"""/metrics: a golden file from a sim node that lights every family, promtool's lint, the render cache, and every
series the docs name present in that file; the slow counters on every scrape."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.backends.kmsg import KernelLog
from gpuwatch.testing.daemon_process import free_port
from tests.helpers import REPO, SimNode, fake_scontrol, metric_samples, start_sim_node
from tests.remediation.conftest import Spawn, spawn  # noqa: F401  # the ranks of the node's training job
from tests.reporting import FakeRank

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "metrics.txt"
# Values move with the simulated load; the golden file pins names, types, help and label sets.
_VALUE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?) (.+)$")
SXID = "nvidia-nvswitch2: SXid (PCI:0000:87:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
SLOW_SERIES = (
    "gpuwatch_gpu_energy_joules_total",
    "gpuwatch_gpu_violation_seconds_total",
    "gpuwatch_gpu_pcie_replay_total",
)


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


def _report(sim: SimNode, process: FakeRank, gpu: int, **fields: object) -> None:
    """A trainer rank's report as TrainerLink sends it."""
    body = {"t": sim.clock.t, "gpu_uuid": sim.daemon.monitor.statics[gpu].uuid, **fields}
    process.report(sim.daemon.config.runtime_dir, **body)


def _incident_status(sim: SimNode) -> str:
    incidents = sim.client.get("/v1/incidents").json()["incidents"]
    return str(incidents[0]["status"]) if incidents else ""


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def every_family(tmp_path: Path, spawn: Spawn) -> Iterator[SimNode]:  # noqa: F811
    """A sim node on which every family of /metrics has samples: the `all_series` scenario (faults of each kind),
    Slurm and the fleet breaker on, a kernel log with an NVSwitch line, a training job that is stopped by a
    quarantine and resumes, a drill verdict and a skipped drill."""
    program, _ = fake_scontrol(tmp_path)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(f"4,1,5000000,-;{SXID}\n")
    sim = start_sim_node(
        tmp_path,
        "all_series",
        gpus=8,
        expected_gpus=8,
        **{
            "slurm.enabled": True,
            "slurm.scontrol": program,
            "slurm.node_name": "n",
            "fleet.prometheus_url": f"http://127.0.0.1:{free_port()}",  # nothing there: the breaker is blind
            "fleet.timeout_s": 0.2,
            "trainer.grace_period_s": 0.5,
            "trainer.kill_after_s": 0.5,
        },
    )
    try:
        sim.daemon.kernel_log = KernelLog(str(kmsg), tuple(sim.daemon.monitor.statics.values()))
        sim.daemon._start_kernel_log()  # the daemon follows it on live backends only
        job = {"job_id": "job-1", "world_size": 2, "step_time_s": 0.2, "reserved_bytes": 2**31}
        stats = {"allocated_bytes": 2**30, "num_alloc_retries": 0, "grad_norm_var": 0.01}
        sim.run_for(120)  # the faults, the quarantines they bring, and the breakers they ask
        ranks = [spawn("cooperative") for _ in range(2)]
        for rank, child in enumerate(ranks):
            _report(sim, child, rank, rank=rank, local_rank=rank, step=40, first_step=1, **job, **stats)
        sim.run_for(5)
        assert sim.client.post("/v1/gpus/0/quarantine", json={"reason": "golden"}, headers=sim.auth).status_code == 200
        _wait("the job stopped", lambda: _incident_status(sim) == "stopped")
        for rank, gpu in enumerate((1, 2)):  # the relaunch, without GPU 0; straggler needs peers to compare
            _report(sim, spawn("cooperative"), gpu, rank=rank, local_rank=rank, step=41, first_step=41, **job, **stats)
        sim.run_for(5)
        _wait("the job resumed", lambda: _incident_status(sim) == "resumed")
        verdict = {
            "drill": "inject", "gpu": 7, "uuid": sim.daemon.monitor.statics[7].uuid, "spec": "gpu=7,preset=xid79",
            "trigger": "cli", "started": sim.clock.t - 10, "finished": sim.clock.t, "result": "pass",
            "broke_at": None, "steps": [{"name": "finding", "result": "pass", "duration_s": 0.5, "detail": "ok"}],
        }  # fmt: skip
        assert sim.client.post("/v1/drills", json=verdict, headers=sim.auth).status_code == 200
        sim.daemon.drills.record.skip("inject", "not_healthy", "the node is not healthy")
        sim.daemon.drainer.step()  # type: ignore[union-attr]  # the drain the Slurm thread would make
        sim.run_for(10)  # ends on a sample that is not a slow one: the slow counters are repeated
        yield sim
    finally:
        sim.close()


def test_metrics_match_golden_file(every_family: SimNode) -> None:
    text = normalise(every_family.client.get("/metrics").text)
    if os.environ.get("GPUWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "metrics changed: rerun with GPUWATCH_UPDATE_GOLDEN=1 and review the diff"


def test_every_family_in_the_golden_file_has_samples() -> None:
    """Not only HELP and TYPE: each family the daemon exposes has a sample line, so its labels are pinned too."""
    golden = GOLDEN.read_text()
    families = re.findall(r"^# TYPE (\S+) ", golden, re.MULTILINE)
    empty = [name for name in families if not re.search(rf"^{name}(\{{| )", golden, re.MULTILINE)]
    assert empty == []


def documented_series() -> dict[str, set[str]]:
    """Every metric name README.md, docs/ and the install guide name, by the file that names it.

    A name glued to `:` is a recording rule's, one followed by `-` or `*` a file name or a prefix.
    """
    pages = [REPO / "README.md", REPO / "systemd" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found: dict[str, set[str]] = {}
    for page in pages:
        for name in re.findall(r"(?<![\w:])gpuwatch_[a-z0-9_]*[a-z0-9](?![\w:*-])", page.read_text()):
            found.setdefault(name, set()).add(page.name)
    return found


def interference_conditions() -> set[str]:
    """The interference bench's condition keys (`gpuwatch_1s`: what runs beside the job), from its page's table."""
    page = (REPO / "docs" / "performance-interference.md").read_text()
    table = page.split("## What runs beside it", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))


def test_every_documented_series_is_in_the_golden_file() -> None:
    golden = GOLDEN.read_text()
    exposed = set(re.findall(r"^(gpuwatch_\w+)[{ ]", golden, re.MULTILINE))
    documented = documented_series()
    assert len(documented) > 50, sorted(documented)  # not vacuous: the metrics reference names them all
    conditions = interference_conditions()  # condition names, no series
    assert "gpuwatch_1s" in conditions, sorted(conditions)
    missing = {name: sorted(pages) for name, pages in documented.items() if name not in exposed | conditions}
    assert missing == {}


def test_every_exposed_family_is_in_the_metrics_reference() -> None:
    """The other way round: a series the daemon exports but docs/metrics.md does not list is one nobody can use."""
    families = set(re.findall(r"^# TYPE (\S+) ", GOLDEN.read_text(), re.MULTILINE))
    assert len(families) > 50, sorted(families)
    reference = {name for name, pages in documented_series().items() if "metrics.md" in pages}
    assert sorted(families - reference) == []


def test_a_scrape_at_any_tick_has_the_slow_counters(tmp_path: Path) -> None:
    """They are read every slow_interval_s (300 s) and repeated in between, so rate() over them always works."""
    node = start_sim_node(tmp_path, "healthy", gpus=2, interval_s=30.0)
    try:
        for _ in range(25):  # 750 s: two slow samples and the ticks between them
            node.run_for(30, step=30)
            text = node.client.get("/metrics").text
            for name in SLOW_SERIES:
                assert {labels["gpu"] for labels, _ in metric_samples(text, name)} == {"0", "1"}, (name, node.clock.t)
    finally:
        node.close()


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
