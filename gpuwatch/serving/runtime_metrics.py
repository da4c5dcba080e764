"""The runtime directory's metric families: trainer reports refused (and why), report connections, status.json errors.

A refused report is a rank the daemon may not see (its user is over a bound, it floods, it sent
garbage): remediation never acts on a rank for the lack of its report, so these say why a rank
might be missing from the trainer series, and alert before anyone wonders.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.snapshots.prune import SquatWatch

REASONS = ("invalid", "too_large", "rate", "user_limit", "node_limit")


class RuntimeCollector(Collector):
    """Refused reports by reason, report connections, status.json write errors, snapshot dir squats."""

    def __init__(self, runtime: RuntimeDir, squats: SquatWatch | None = None) -> None:
        self.runtime = runtime
        self.squats = squats or SquatWatch()

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "gpuwatch_reports_refused",
            "Trainer reports or connections refused, by reason (invalid, too_large, rate, user_limit, node_limit).",
            labels=["reason"],
        )
        counts = dict(self.runtime.board.refused)
        for reason in REASONS:
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        yield GaugeMetricFamily(
            "gpuwatch_report_connections",
            "Trainer ranks connected to the report socket now.",
            value=self.runtime.board.connections(),
        )
        yield CounterMetricFamily(
            "gpuwatch_runtime_status_write_errors",
            "Failed writes of status.json (full or read-only runtime dir): ranks then see quarantines by signal only.",
            value=self.runtime.status_write_errors,
        )
        yield GaugeMetricFamily(
            "gpuwatch_snapshot_dir_squats",
            "Names in the host snapshot root that claim a user but are another user's directories (left standing; "
            "that user's jobs snapshot to a directory of random name).",
            value=self.squats.standing,
        )
        yield CounterMetricFamily(
            "gpuwatch_snapshot_dir_squats_removed",
            "Links and files in the host snapshot root that claimed a user they did not belong to, removed.",
            value=self.squats.removed,
        )
