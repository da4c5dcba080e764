"""dashboards/grafana/gpuwatch.json: valid, wired to its variables, and querying only metrics gpuwatch exposes.

The names a query may use come from rendering gpuwatch.serving.metrics for a fully populated GPU, plus
the families other modules add (EXTRA_METRICS) and the series Prometheus makes per target.
`dashboard_queries()` turns every panel query into plain PromQL, for checks against a real
Prometheus as well as the ones here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.model import (
    Action,
    Finding,
    GpuError,
    GpuSample,
    GpuStatic,
    GpuStatus,
    Health,
    Severity,
    Snapshot,
)
from gpuwatch.serving.metrics import MetricsRenderer, SnapshotCollector

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "grafana" / "gpuwatch.json"

# Families exposed by the trainer, drill, incident, Slurm and fleet collectors, which gpuwatch.serving.metrics only
# hosts.
EXTRA_METRICS = frozenset(
    {
        "gpuwatch_trainer_memory_fragmentation_ratio",
        "gpuwatch_trainer_step_time_seconds",
        "gpuwatch_trainer_straggler",
        "gpuwatch_trainer_alloc_retries_total",
        "gpuwatch_trainer_grad_norm_variance",
        "gpuwatch_drill_last_run_timestamp_seconds",
        "gpuwatch_drill_step_duration_seconds",
        "gpuwatch_drill_runs_total",
        "gpuwatch_incidents_total",
        "gpuwatch_incidents_refused_total",
        "gpuwatch_reports_refused_total",
        "gpuwatch_report_connections",
        "gpuwatch_runtime_status_write_errors_total",
        "gpuwatch_incident_time_to_stop_seconds",
        "gpuwatch_incident_time_to_resume_seconds",
        "gpuwatch_slurm_drained",
        "gpuwatch_slurm_scontrol_failing",
        "gpuwatch_fleet_breaker_refusals_total",
        "gpuwatch_fleet_prometheus_up",
    }
)
# Series Prometheus itself records for every scrape target.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds"})

# What Grafana puts in place of its variables; a stand-in that keeps each query valid PromQL.
VARIABLE_VALUES = {
    "instance": ".*",
    "gpu": ".*",
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
}
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")

_STRING = re.compile(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'|`[^`]*`")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE)
_NAME = re.compile(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:]|\s*\()")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"inf", "nan", "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk"}
    | {"quantile", "count_values"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and label names excluded)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGE.sub("", text)
    text = _LABEL_LIST.sub(" ", text)
    return {name for name in _NAME.findall(text) if name.lower() not in _KEYWORDS}


def _populated_snapshot() -> Snapshot:
    """One GPU with every optional field set, so every family gpuwatch.serving.metrics can emit is emitted."""
    text = {"index", "uuid", "name", "pci_bus_id"}
    limits = {f.name: 1 for f in dataclasses.fields(GpuStatic) if f.name not in text}
    static = GpuStatic(0, "GPU-0", name="NVIDIA H200", pci_bus_id="00000000:19:00.0", **limits)
    numeric = {f.name: 1 for f in dataclasses.fields(GpuSample) if f.name not in {"t", "index", "uuid", "pids"}}
    sample = GpuSample(t=1.0, index=0, uuid="GPU-0", pids=(4242,), **numeric)
    finding = Finding("xid_critical", Severity.UNHEALTHY, "XID 79", Action.REBOOT, t=1.0, index=0, uuid="GPU-0")
    status = GpuStatus(
        static=static,
        state=Health.UNHEALTHY,
        findings=(finding,),
        quarantined=True,
        epoch=1,
        sample=sample,
        error=GpuError(t=1.0, index=0, uuid="GPU-0", kind="gpu_lost"),
        xid_counts=((79, 1),),
    )
    return Snapshot(t=1.0, backend="sim", gpus=(status,), samples_total=1, kernel_log_readable=True)


@cache
def known_metric_names() -> frozenset[str]:
    """Every name a dashboard or rule may query: what gpuwatch exposes, plus the extras above."""
    snapshot = _populated_snapshot()
    renderer = MetricsRenderer(SnapshotCollector(lambda: snapshot, expected_gpus=1), key=lambda: 0)
    exposed = {
        sample.name
        for family in text_string_to_metric_families(renderer.render().decode())
        for sample in family.samples
    }
    return frozenset(exposed) | EXTRA_METRICS | PROMETHEUS_SERIES


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def substitute(expr: str) -> str:
    """Replace Grafana's variables with concrete stand-ins; an unknown variable is a KeyError."""
    return _VARIABLE.sub(lambda m: VARIABLE_VALUES[m.group(1) or m.group(2)], expr)


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    """Every panel query of the dashboard as plain PromQL, variables substituted."""
    return [
        substitute(target["expr"])
        for panel in iter_panels(load_dashboard(path)["panels"])
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in load_dashboard()["templating"]["list"]}


def test_metric_names_parser() -> None:
    assert metric_names('max by (gpu) (gpuwatch_gpu_health_state{state="unknown"} * 1 or up == 0)') == {
        "gpuwatch_gpu_health_state",
        "up",
    }
    assert metric_names("sum without (gpu, uuid) (rate(foo_total[5m] offset 10m)) > bool 8 * 86400") == {"foo_total"}
    assert metric_names('a_b{x="or rate(y)"} + on(job) group_left(drill) (0 * c) unless vector(0)') == {"a_b", "c"}
    assert metric_names("time() - max without(drill, result) (d) > 1e6") == {"d"}


def test_known_names_come_from_the_real_collector() -> None:
    known = known_metric_names()
    assert "gpuwatch_gpu_xid_errors_total" in known
    assert "gpuwatch_gpu_xid_errors" not in known
    assert {"gpuwatch_gpu_health_state", "gpuwatch_gpu_sm_clock_max_hertz", "gpuwatch_samples_total"} <= known


def test_dashboard_is_valid_json_with_identity() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "gpuwatch-node"
    assert dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41


def test_variables() -> None:
    variables = _variables()
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query"
    assert instance["definition"] == "label_values(gpuwatch_gpu_info, instance)"
    gpu = variables["gpu"]
    assert gpu["definition"] == 'label_values(gpuwatch_gpu_info{instance=~"$instance"}, gpu)'
    assert gpu["multi"] is True
    assert gpu["includeAll"] is True
    assert gpu["allValue"] == ".*"
    for variable in (instance, gpu):
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variable["query"]["query"] == variable["definition"]


def test_panels_are_wired_to_the_datasource_variable() -> None:
    panels = list(iter_panels(load_dashboard()["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]


def test_expected_panels_exist() -> None:
    by_type = {(p["type"], p["title"]) for p in iter_panels(load_dashboard()["panels"])}
    assert ("state-timeline", "Health state") in by_type
    assert ("table", "Quarantined GPUs") in by_type
    titles = {title for _, title in by_type}
    for title in (
        "SM clock against max",
        "Active clocks-event reasons",
        "Power against limit",
        "Temperature against slowdown threshold",
        "XID events since daemon start",
        "ECC errors",
        "Row remapping",
        "Allocator fragmentation per rank",
        "Step time per rank",
        "Last drill runs",
        "Sample duration",
    ):
        assert title in titles


def test_health_state_mappings_name_every_state() -> None:
    panel = next(p for p in iter_panels(load_dashboard()["panels"]) if p["title"] == "Health state")
    mapping = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {m["text"] for m in mapping.values()} == {h.value for h in Health}


def test_every_query_uses_known_metrics() -> None:
    known = known_metric_names()
    queries = dashboard_queries()
    assert len(queries) >= 30
    for query in queries:
        names = metric_names(query)
        assert names, f"no metric in {query!r}"
        assert names <= known, f"unknown metric {sorted(names - known)} in {query!r}"


def test_variable_queries_use_known_metrics() -> None:
    for name in ("instance", "gpu"):
        inner = re.fullmatch(r"label_values\((.*), \w+\)", _variables()[name]["definition"])
        assert inner is not None
        assert metric_names(substitute(inner.group(1))) <= known_metric_names()


def test_every_query_follows_the_variables() -> None:
    """Each query is filtered to the chosen node, and each per-GPU series to the chosen GPUs."""
    for panel in iter_panels(load_dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            selectors = re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", expr)
            assert selectors, expr
            for name, matchers in selectors:
                assert 'instance=~"$instance"' in matchers, f"{name} in {panel['title']!r} ignores $instance"
                if name.startswith(("gpuwatch_gpu_", "gpuwatch_trainer_")) and "grad_norm" not in name:
                    assert 'gpu=~"$gpu"' in matchers, f"{name} in {panel['title']!r} ignores $gpu"


def test_substitution_leaves_plain_promql() -> None:
    queries = dashboard_queries()
    assert all("$" not in q for q in queries)
    assert substitute('rate(x{instance=~"${instance}", gpu=~"$gpu"}[$__rate_interval])') == (
        'rate(x{instance=~".*", gpu=~".*"}[1m])'
    )
    with pytest.raises(KeyError):
        substitute("x[$__unknown]")


def test_queries_parse_as_promql(tmp_path: Path) -> None:
    """promtool parses every query: each becomes a recording rule of a throwaway rules file."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard_query_{i}", "expr": q} for i, q in enumerate(dashboard_queries())],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
