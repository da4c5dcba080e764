"""The fleet-wide circuit breaker: before an automatic quarantine or a Slurm drain, ask Prometheus.

The node's own breaker (health/state.py) cannot see a bad driver roll-out or a cooling failure
condemning cards on 40 nodes at once; Prometheus, which scrapes every node, can. Two numbers:

* the share of the fleet's GPUs that are quarantined: the recording rule
  `fleet:gpuwatch_gpus_quarantined:ratio` (dashboards/prometheus/gpuwatch-recording.yml);
* how many nodes gpuwatch drained in Slurm within `fleet.window_s`.

Beyond `fleet.max_quarantined_share` an automatic quarantine is refused; beyond
`fleet.max_drained_nodes` a drain is. Prometheus unreachable: `on_unreachable = "open"` lets the
node breaker alone decide (and says so), `"closed"` refuses. One answer serves `cache_s` seconds,
a query waits at most `timeout_s`, and after a failure Prometheus is asked again no sooner than
UNREACHABLE_RETRY_S, so the sampling thread that asks is never held for long.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.config import FleetConfig
from gpuwatch.errors import GpuwatchError

log = logging.getLogger("gpuwatch.fleet")

QUARANTINED_SHARE = "fleet:gpuwatch_gpus_quarantined:ratio"
UNREACHABLE_RETRY_S = 30.0  # a failed ask is repeated no sooner: a black-holed Prometheus costs timeout_s per 30 s


def drained_nodes_query(window_s: float) -> str:
    """Nodes whose gpuwatch_slurm_drained was 1 at any time within the window (0 when none)."""
    return f"count(max_over_time(gpuwatch_slurm_drained[{int(window_s)}s]) == 1) or vector(0)"


class FleetError(GpuwatchError):
    """Prometheus could not be asked, or had no answer."""


@dataclass(frozen=True)
class FleetView:
    """What Prometheus says about the fleet; `error` set when it could not be asked."""

    quarantined_share: float = 0.0
    drained_nodes: int = 0
    error: str = ""


def judge_quarantine(view: FleetView, config: FleetConfig) -> str | None:
    """None allows an automatic quarantine; otherwise the refusal, one line."""
    if view.error:
        return _unreachable(view, config)
    if not view.quarantined_share < config.max_quarantined_share:  # a nan limit (unvalidated Config) refuses
        return (
            f"{view.quarantined_share:.1%} of the fleet's GPUs are quarantined, at or above "
            f"fleet.max_quarantined_share {config.max_quarantined_share:.1%}"
        )
    return None


def judge_drain(view: FleetView, config: FleetConfig) -> str | None:
    """None allows a Slurm drain; otherwise the refusal, one line."""
    if view.error:
        return _unreachable(view, config)
    if not view.drained_nodes < config.max_drained_nodes:
        return (
            f"{view.drained_nodes} node(s) drained by gpuwatch in the last {config.window_s:g} s, at or above "
            f"fleet.max_drained_nodes {config.max_drained_nodes}"
        )
    return None


def _unreachable(view: FleetView, config: FleetConfig) -> str | None:
    if config.on_unreachable == "closed":
        return f"Prometheus cannot be asked ({view.error}) and fleet.on_unreachable is closed"
    return None


class Prometheus:
    """The instant-query HTTP API, with a timeout; every failure is one FleetError line."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def scalar(self, expr: str) -> float:
        """The value of a query that returns one sample.

        Raises:
            FleetError: unreachable, an error status, or not exactly one sample (a missing recording rule).
        """
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise FleetError(f"{self.url}: {getattr(exc, 'reason', exc)}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise FleetError(f"{self.url}: query {expr!r} failed: {str(body)[:200]}")
        result = body.get("data", {}).get("result")
        if not isinstance(result, list) or len(result) != 1:
            count = len(result) if isinstance(result, list) else "no"
            raise FleetError(f"{self.url}: query {expr!r} returned {count} series, not 1 (recording rules loaded?)")
        try:
            return float(result[0]["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise FleetError(f"{self.url}: query {expr!r}: unreadable sample {result[0]!r}") from None


@dataclass(frozen=True)
class FleetStatus:
    """What the fleet collector exports; hashable, so it is also part of the /metrics render key."""

    reachable: bool = True
    quarantined_share: float = 0.0
    drained_nodes: int = 0
    tripped: bool = False  # the last answer is beyond a limit: a quarantine or drain asked now is refused
    refusals_total: int = 0  # GPUs (and drains) refused, each counted once until the breaker lets go
    query_failures_total: int = 0


class FleetCollector(Collector):
    """gpuwatch_fleet_* from the breaker's status."""

    def __init__(self, status: Callable[[], FleetStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        s = self._status()
        yield GaugeMetricFamily(
            "gpuwatch_fleet_prometheus_up", "1 if the last query to fleet.prometheus_url succeeded.", value=s.reachable
        )
        yield GaugeMetricFamily(
            "gpuwatch_fleet_quarantined_ratio",
            "Share of the fleet's GPUs quarantined, as last read.",
            s.quarantined_share,
        )
        yield GaugeMetricFamily(
            "gpuwatch_fleet_drained_nodes",
            "Nodes gpuwatch drained within fleet.window_s, as last read.",
            s.drained_nodes,
        )
        yield GaugeMetricFamily(
            "gpuwatch_fleet_breaker_tripped",
            "1 while the fleet's numbers, as last read, are beyond a limit of the fleet breaker.",
            s.tripped,
        )
        yield CounterMetricFamily(
            "gpuwatch_fleet_breaker_refusals", "Quarantines and drains the fleet breaker refused.", s.refusals_total
        )
        yield CounterMetricFamily(
            "gpuwatch_fleet_query_failures", "Queries to fleet.prometheus_url that failed.", s.query_failures_total
        )


class FleetBreaker:
    """Asks Prometheus at most once per `cache_s` and judges quarantines and drains against the limits."""

    def __init__(
        self, config: FleetConfig, prometheus: Prometheus | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.prometheus = prometheus or Prometheus(config.prometheus_url, config.timeout_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._view: FleetView | None = None
        self._asked = float("-inf")
        self._refused: set[str] = set()
        self._status = FleetStatus()

    def status(self) -> FleetStatus:
        return self._status

    def view(self) -> FleetView:
        """The cached answer, or a fresh one when it is older than `cache_s`."""
        with self._lock:
            ttl = (
                max(self.config.cache_s, UNREACHABLE_RETRY_S)
                if self._view and self._view.error
                else self.config.cache_s
            )
            if self._view is not None and self.clock() - self._asked < ttl:
                return self._view
            view = self._ask()
            self._view, self._asked = view, self.clock()
            tripped = judge_quarantine(view, self.config) is not None or judge_drain(view, self.config) is not None
            if not tripped:
                self._refused.clear()
            self._status = dataclasses.replace(self._status, tripped=tripped)
            return view

    def allow_quarantine(self, index: int, reason: str) -> str | None:
        """The monitor's quarantine gate: None allows, else the refusal."""
        return self._verdict(f"gpu {index}", judge_quarantine(self.view(), self.config))

    def allow_drain(self) -> str | None:
        """The drainer's gate: None allows, else the refusal."""
        return self._verdict("drain", judge_drain(self.view(), self.config))

    def _verdict(self, what: str, refusal: str | None) -> str | None:
        with self._lock:
            new = refusal is not None and what not in self._refused
            if refusal is None:
                self._refused.discard(what)
            else:
                self._refused.add(what)
            self._status = dataclasses.replace(self._status, refusals_total=self._status.refusals_total + new)
        return refusal

    def _ask(self) -> FleetView:
        try:
            share = self.prometheus.scalar(QUARANTINED_SHARE)
            drained = int(self.prometheus.scalar(drained_nodes_query(self.config.window_s)))
        except FleetError as exc:
            if self._status.reachable:
                fallback = "refusing" if self.config.on_unreachable == "closed" else "the node breaker alone decides"
                log.warning("fleet breaker: cannot ask Prometheus: %s; %s until it answers", exc, fallback)
            self._status = dataclasses.replace(
                self._status, reachable=False, query_failures_total=self._status.query_failures_total + 1
            )
            return FleetView(error=str(exc))
        if not self._status.reachable:
            log.warning("fleet breaker: Prometheus answers again")
        self._status = dataclasses.replace(self._status, reachable=True, quarantined_share=share, drained_nodes=drained)
        return FleetView(share, drained)
