"""Prometheus rules, their promtool tests, the runbook and the Alertmanager routing, checked with the real tools."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatch.health.xid_catalog import CATALOG
from gpuwatch.model import Severity
from gpuwatch.service.layout import SHIPPED_RUNBOOK_URL
from tests.prometheus_stack import Webhook, alertmanager_config, alertmanager_process, program
from tests.test_grafana_dashboard import known_metric_names, metric_names

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
PROMETHEUS = DASHBOARDS / "prometheus"
ALERTS = PROMETHEUS / "gpuwatch-alerts.yml"
RECORDING = PROMETHEUS / "gpuwatch-recording.yml"
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
ALERTMANAGER = DASHBOARDS / "alertmanager" / "alertmanager.yml"
RUNBOOK = DASHBOARDS / "RUNBOOK.md"
RUNBOOK_BASE = SHIPPED_RUNBOOK_URL + "#"  # `gpuwatch service assets` points it at its own copy
SEVERITIES = {"critical", "warning", "info"}
PER_GPU = re.compile(r"\bgpuwatch_(?:gpu|trainer)_\w+")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def recording_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RECORDING.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def rule_test_cases() -> Iterator[dict[str, Any]]:
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            yield from test.get("alert_rule_test", [])


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors() -> set[str]:
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.MULTILINE)}


def test_promtool_check_rules() -> None:
    proc = run(program("promtool"), "check", "rules", str(ALERTS), str(RECORDING))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_promtool_unit_tests() -> None:
    assert RULE_TESTS, "no promtool test files"
    proc = run(program("promtool"), "test", "rules", *map(str, RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_example_prometheus_config() -> None:
    proc = run(program("promtool"), "check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_amtool_check_config() -> None:
    proc = run(program("amtool"), "check-config", str(ALERTMANAGER))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=GpuwatchGpuUnhealthy", "severity=critical", "drill=true"], "drill"),
        (["alertname=GpuwatchRowRemapPending", "severity=warning", "drill=true"], "drill"),
        (["alertname=GpuwatchGpuUnhealthy", "severity=critical", "drill=false"], "pager"),
        (["alertname=GpuwatchDown", "severity=critical"], "pager"),
        (["alertname=GpuwatchGpuQuarantined", "severity=warning", "drill=false"], "chat"),
        (["alertname=GpuwatchDrillFailed", "severity=warning", "drill=xid31"], "chat"),
        (["alertname=Other", "severity=info"], "chat"),
    ],
)
def test_routing(labels: list[str], receiver: str) -> None:
    proc = run(
        program("amtool"),
        "config",
        "routes",
        "test",
        f"--config.file={ALERTMANAGER}",
        f"--verify.receivers={receiver}",
        *labels,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_have_severity_summary_and_runbook() -> None:
    anchors = runbook_anchors()
    rules = alert_rules()
    assert len(rules) >= 15
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert annotations["description"], name
        summary = annotations["summary"]
        if PER_GPU.search(rule["expr"]):
            for label in ("gpu", "uuid", "instance"):
                assert f"{{{{ $labels.{label} }}}}" in summary, f"{name}: summary lacks {label}"
        elif name != "GpuwatchAbsent":  # absent() has no instance to name
            assert "{{ $labels.instance }}" in summary, f"{name}: summary lacks instance"
        url = annotations["runbook_url"]
        assert url == RUNBOOK_BASE + "runbook-" + name.lower(), name
        assert url.removeprefix(RUNBOOK_BASE) in anchors, f"{name}: no '### Runbook: {name}' in {RUNBOOK.name}"


def test_runbook_has_no_orphans() -> None:
    names = {rule["alert"] for rule in alert_rules()}
    headings = set(re.findall(r"^### Runbook: (\w+)$", RUNBOOK.read_text(), re.MULTILINE))
    assert headings == names


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in rule_test_cases():
        (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fires == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"


def test_per_gpu_alerts_keep_the_drill_label() -> None:
    """Each alert over per-GPU series fires in some test with `drill` among its labels."""
    with_drill = {
        case["alertname"]
        for case in rule_test_cases()
        for alert in case.get("exp_alerts", [])
        if "drill" in alert.get("exp_labels", {})
    }
    for rule in alert_rules():
        if re.search(r"\bgpuwatch_gpu_\w+", rule["expr"]):
            assert rule["alert"] in with_drill, rule["alert"]


def test_a_drill_unhealthy_gpu_alerts_with_drill_true() -> None:
    assert any(
        alert["exp_labels"].get("drill") == "true"
        for case in rule_test_cases()
        if case["alertname"] == "GpuwatchGpuUnhealthy"
        for alert in case.get("exp_alerts", [])
    )


def test_every_recording_rule_is_tested() -> None:
    tested = {
        case["expr"]
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("promql_expr_test", [])
    }
    assert {rule["record"] for rule in recording_rules()} <= tested


def test_rules_use_known_metrics() -> None:
    known = known_metric_names()
    for rule in alert_rules() + recording_rules():
        names = metric_names(rule["expr"])
        assert names, rule
        assert names <= known, f"unknown metric {sorted(names - known)} in {rule.get('alert') or rule['record']}"


def test_xid_counter_codes_match_the_catalog() -> None:
    """The counter branch of GpuwatchXidCritical pages for exactly the XIDs the daemon rates unhealthy."""
    expr = next(rule["expr"] for rule in alert_rules() if rule["alert"] == "GpuwatchXidCritical")
    regexes = set(re.findall(r'xid=~"([^"]+)"', expr))
    assert len(regexes) == 1, regexes
    unhealthy = {xid for xid, info in CATALOG.items() if info.severity is Severity.UNHEALTHY}
    assert {int(code) for code in regexes.pop().split("|")} == unhealthy


def test_github_anchor() -> None:
    assert github_anchor("Runbook: GpuwatchGpuUnhealthy") == "runbook-gpuwatchgpuunhealthy"
    assert github_anchor(" Runbook: Foo_bar (x) ") == "runbook-foo_bar-x"


@pytest.mark.slow
def test_alertmanager_routes_and_inhibits(tmp_path: Path) -> None:
    """A real Alertmanager with this config: drills to `drill`, inhibited alerts nowhere."""
    with Webhook() as webhook, alertmanager_process(tmp_path, alertmanager_config(webhook)) as alertmanager:

        def alert(name: str, instance: str, severity: str, **labels: str) -> dict[str, Any]:
            return {"labels": {"alertname": name, "instance": instance, "severity": severity, **labels}}

        gpu = {"gpu": "0", "uuid": "GPU-0"}
        alerts = [
            alert("GpuwatchGpuUnhealthy", "node-1:9835", "critical", drill="true", **gpu),
            alert("GpuwatchGpuUnhealthy", "node-2:9835", "critical", drill="false", **gpu),
            alert("GpuwatchGpuDegraded", "node-2:9835", "warning", drill="false", **gpu),
            alert("GpuwatchDown", "node-3:9835", "critical"),
            alert("GpuwatchGpuQuarantined", "node-3:9835", "warning", drill="false", **gpu),
            alert("GpuwatchGpuQuarantined", "node-4:9835", "warning", drill="false", **gpu),
        ]
        request = urllib.request.Request(
            alertmanager.url + "/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=5).close()
        expected = {
            ("/drill", "GpuwatchGpuUnhealthy", "node-1:9835"),
            ("/pager", "GpuwatchGpuUnhealthy", "node-2:9835"),
            ("/pager", "GpuwatchDown", "node-3:9835"),
            ("/chat", "GpuwatchGpuQuarantined", "node-4:9835"),
        }
        deadline = time.monotonic() + 30
        while not expected <= received(webhook) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # several group intervals: an inhibited alert would have arrived by now
        assert received(webhook) == expected


def received(webhook: Webhook) -> set[tuple[str, str, str]]:
    """(path, alertname, instance) of every alert Alertmanager delivered."""
    return {(path, a["labels"]["alertname"], a["labels"]["instance"]) for path, a in list(webhook.received)}
