"""The daemon's record of drills: verdicts stored in SQLite, skips counted, both exported as metrics.

The last run of each drill is read back from SQLite at start, so "last successful drill" survives a
restart; the counters count since the daemon started, as Prometheus counters do.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatch.drills.steps import FAIL, PASS
from gpuwatch.node.store import Store

if TYPE_CHECKING:  # pydantic loads with the first answer read, not with the daemon that imports the drills
    from gpuwatch.serving import wire

log = logging.getLogger("gpuwatch.drills")
_RECALLED_RUNS = 1000


class DrillRecord:
    """Thread-safe: the scheduler's threads and the API's handlers both write here."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._version = 0
        self._last: dict[tuple[str, str], float] = {}
        self._steps: dict[str, dict[str, float]] = {}
        self._runs: Counter[tuple[str, str]] = Counter()
        self._skipped: Counter[tuple[str, str]] = Counter()
        for row in reversed(store.drill_runs(limit=_RECALLED_RUNS)):
            self._remember(row)

    def record(self, verdict: dict[str, Any]) -> None:
        """Store a verdict (from a scheduled run, or POSTed by the CLI) and update the metrics."""
        self._store.add_drill_run(verdict["finished"], verdict["drill"], verdict["result"], verdict)
        with self._lock:
            self._remember(verdict)
            self._runs[(verdict["drill"], verdict["result"])] += 1
            self._version += 1
        level = logging.INFO if verdict["result"] == PASS else logging.WARNING
        where = f" at step {verdict['broke_at']}" if verdict.get("broke_at") else ""
        log.log(level, "drill %s on GPU %s: %s%s", verdict["drill"], verdict["gpu"], verdict["result"], where)

    def skip(self, drill: str, reason: str, detail: str) -> None:
        with self._lock:
            self._skipped[(drill, reason)] += 1
            self._version += 1
        log.warning("scheduled drill %s skipped (%s): %s", drill, reason, detail)

    def runs(self, limit: int) -> list[wire.DrillRun]:
        """The newest `limit` verdicts, for GET /v1/drills."""
        from gpuwatch.serving import wire

        return [wire.DrillRun.model_validate(run) for run in self._store.drill_runs(limit=limit)]

    def skipped(self) -> list[wire.DrillSkip]:
        """The skips by drill and reason, for GET /v1/drills."""
        from gpuwatch.serving import wire

        with self._lock:
            return [wire.DrillSkip(drill=d, reason=r, count=n) for (d, r), n in sorted(self._skipped.items())]

    def key(self) -> object:
        """Changes whenever the metrics would: the /metrics render cache keys on it."""
        return ("drills", self._version)

    def collect(self) -> Iterator[Metric]:
        last = GaugeMetricFamily(
            "gpuwatch_drill_last_run_timestamp_seconds",
            "When the last run of each drill ended, by result (pass or fail).",
            labels=["drill", "result"],
        )
        steps = GaugeMetricFamily(
            "gpuwatch_drill_step_duration_seconds",
            "How long each step of the last run of each drill took (steps that ran).",
            labels=["drill", "step"],
        )
        runs = CounterMetricFamily(
            "gpuwatch_drill_runs", "Drill runs with a verdict, by result.", labels=["drill", "result"]
        )
        skipped = CounterMetricFamily(
            "gpuwatch_drill_skipped", "Scheduled drill runs a guard skipped, by reason.", labels=["drill", "reason"]
        )
        with self._lock:
            for (drill, result), t in sorted(self._last.items()):
                last.add_metric([drill, result], t)
            for drill, durations in sorted(self._steps.items()):
                for step, seconds in durations.items():
                    steps.add_metric([drill, step], seconds)
            for (drill, result), n in sorted(self._runs.items()):
                runs.add_metric([drill, result], n)
            for (drill, reason), n in sorted(self._skipped.items()):
                skipped.add_metric([drill, reason], n)
        yield from (last, steps, runs, skipped)

    def _remember(self, verdict: dict[str, Any]) -> None:
        drill, finished = verdict["drill"], float(verdict.get("finished", verdict.get("t", 0.0)))
        key = (drill, verdict["result"])
        self._last[key] = max(self._last.get(key, 0.0), finished)
        ran = [s for s in verdict.get("steps", []) if s["result"] in (PASS, FAIL)]
        self._steps[drill] = {s["name"]: float(s["duration_s"]) for s in ran}
