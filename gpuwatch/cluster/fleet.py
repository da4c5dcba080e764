"""The fleet-wide circuit breaker: before an automatic quarantine or a Slurm drain, ask Prometheus.

The node's own breaker (health/state.py) cannot see a bad driver roll-out or a cooling failure
condemning cards on 40 nodes at once; Prometheus, which scrapes every node, can. Two numbers:

* the share of the fleet's GPUs that are quarantined: the recording rule
  `fleet:gpuwatch_gpus_quarantined:ratio` (dashboards/prometheus/gpuwatch-recording.yml);
* how many nodes gpuwatch drained in Slurm within `fleet.window_s`: the recording rule
  `fleet:gpuwatch_slurm_drained_nodes:count1h` for the default hour (computed once for the fleet,
  not once per node that asks: over every node's hour of samples it is the costly one), or the nodes
  drained now where more (the hour's rule runs every 30 s: a burst of drains within them counts), the
  query itself for any other window.

Beyond `fleet.max_quarantined_share` an automatic quarantine is refused; beyond
`fleet.max_drained_nodes` a drain is. Prometheus unreachable: `on_unreachable = "open"` lets the
node breaker alone decide (and says so), `"closed"` refuses.

Every node asks the same Prometheus, so a bad one must not stall any of them, and the fleet's
asks must not become its load: the share is read every `cache_s` seconds, stretched by up to
JITTER at random each time (nodes started together drift apart instead of asking in step), by a
thread of its own (FleetBreaker.start) and a quarantine is judged on
the last reading, never waited for: an XID is judged on the event thread, other faults on the
sampling thread. The drained count (a costlier query, needed only for the rare drain) is asked
when a drain is judged, on the drainer's own thread, which may wait. Each ask takes at most
`timeout_s` in all (peer_http: whatever the server trickles) over one kept-alive connection (made
again after any error), reads at most MAX_ANSWER_BYTES,
refuses JSON nested deeper than MAX_JSON_DEPTH and values that are not finite and non-negative (a
share above 1); each of those, and any other error, counts as unreachable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.cluster.peer_http import Peer, PeerError, loads
from gpuwatch.config import FleetConfig
from gpuwatch.errors import GpuwatchError

log = logging.getLogger("gpuwatch.fleet")

QUARANTINED_SHARE = "fleet:gpuwatch_gpus_quarantined:ratio"
# The hour's count (the recording rule fleet:gpuwatch_slurm_drained_nodes:count1h) is evaluated every 30 s;
# the nodes drained now (the breaker group's sum, evaluated with the share) cover a burst of drains within
# those 30 s. The larger of the two records.
DRAINED_NODES_1H_QUERY = 'max({__name__=~"fleet:gpuwatch_slurm_drained_nodes:(count1h|sum)"})'
MIN_PERIOD_S = 1.0  # the share is read no more often, whatever cache_s says (0 is allowed)
JITTER = 0.25  # each period is cache_s times 1 to 1 + JITTER
UNREACHABLE_RETRY_S = 5.0  # after a failure, the share is read again no sooner
MAX_ANSWER_BYTES = 1 << 20  # an instant query of one sample is a few hundred bytes
MAX_JSON_DEPTH = 16  # {"data": {"result": [{"value": [t, v]}]}} is 5


def drained_nodes_query(window_s: float) -> str:
    """Nodes whose gpuwatch_slurm_drained was 1 at any time within the window (0 when none): the recording
    rule for the default hour, the query itself for another window."""
    if int(window_s) == 3600:
        return DRAINED_NODES_1H_QUERY
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
    """The instant-query HTTP API, within a deadline; every failure is one FleetError line."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.peer = Peer(self.url)  # one kept-alive connection, asked again every cache_s
        self._path = urllib.parse.urlsplit(self.url).path

    def scalar(self, expr: str, deadline_s: float | None = None) -> float:
        """The value of a query that returns one sample: finite and non-negative. Takes at most `deadline_s`
        (default `timeout_s`), however slowly the server answers.

        Raises:
            FleetError: unreachable, too slow, too large, an error status, not exactly one sample (a missing
                recording rule), or a value that is not a finite, non-negative number.
        """
        target = f"{self._path}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            status, raw = self.peer.get(target, self.timeout_s if deadline_s is None else deadline_s, MAX_ANSWER_BYTES)
            body = loads(raw, MAX_JSON_DEPTH)
        except PeerError as exc:
            raise FleetError(f"{self.url}: {exc}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise FleetError(f"{self.url}: query {expr!r} failed (HTTP {status}): {str(body)[:200]}")
        data = body.get("data")
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != 1:
            count = len(result) if isinstance(result, list) else "no"
            raise FleetError(f"{self.url}: query {expr!r} returned {count} series, not 1 (recording rules loaded?)")
        try:
            value = float(result[0]["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise FleetError(f"{self.url}: query {expr!r}: unreadable sample {str(result[0])[:200]}") from None
        if not math.isfinite(value) or value < 0:
            raise FleetError(f"{self.url}: query {expr!r}: {value} is not a finite, non-negative number")
        return value


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
    """Judges quarantines on the last reading of the fleet's quarantined share, and drains on a fresh ask.

    `allow_quarantine` runs on the sampling and event threads (inside the state machine's step) and
    never waits for Prometheus; `refresh` reads the share (at most `timeout_s`) from the thread
    `start` runs. `allow_drain` asks for the drained count itself: it runs on the drainer's thread
    (and in `gpuwatch check --slurm`), which may wait that long.
    """

    def __init__(
        self, config: FleetConfig, prometheus: Prometheus | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.prometheus = prometheus or Prometheus(config.prometheus_url, config.timeout_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._share: tuple[FleetView, float] = (FleetView(error="not asked yet"), float("-inf"))  # (reading, when)
        self._refused: set[str] = set()
        self._drain_tripped = False
        self._status = FleetStatus()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-fleet", daemon=True)

    def status(self) -> FleetStatus:
        return self._status

    @property
    def period_s(self) -> float:
        """How long until the share is read again: cache_s stretched at random by up to JITTER; after a
        failure, no sooner than UNREACHABLE_RETRY_S."""
        floor = UNREACHABLE_RETRY_S if self._share[0].error else MIN_PERIOD_S
        return max(self.config.cache_s, floor) * (1.0 + JITTER * random.random())

    def view(self) -> FleetView:
        """The last reading of the share, at once; one the thread stopped renewing counts as unreachable."""
        view, read = self._share
        age = self.clock() - read
        stale_after = 3 * (1 + JITTER) * max(self.config.cache_s, UNREACHABLE_RETRY_S) + self.config.timeout_s
        if age > stale_after and not view.error:
            return FleetView(error=f"no answer from Prometheus for {age:.0f} s")
        return view

    def refresh(self) -> FleetView:
        """Read the share now (at most `timeout_s`) and keep it; a failure is kept as unreachable."""
        share, error = self._ask(self._share_now)
        view = FleetView(error=error) if error else FleetView(quarantined_share=share)
        tripped = judge_quarantine(view, self.config) is not None
        with self._lock:
            self._share = (view, self.clock())
            if not tripped:
                self._refused = {what for what in self._refused if not what.startswith("gpu ")}
            status = self._status if error else dataclasses.replace(self._status, quarantined_share=share)
            self._status = dataclasses.replace(status, tripped=tripped or self._drain_tripped)
        return view

    def start(self) -> None:
        """Read the share once now (so the first decisions have a reading), then every `period_s` from a thread."""
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.refresh()

    def allow_quarantine(self, index: int, reason: str) -> str | None:
        """The monitor's quarantine gate, on the last reading: None allows, else the refusal."""
        return self._verdict(f"gpu {index}", judge_quarantine(self.view(), self.config))

    def allow_drain(self) -> str | None:
        """The drainer's gate, on a fresh ask (this thread waits for it, at most `timeout_s`): None allows."""
        drained, error = self._ask(self._drained_now)
        view = FleetView(error=error) if error else FleetView(drained_nodes=int(drained))
        refusal = judge_drain(view, self.config)
        with self._lock:
            self._drain_tripped = refusal is not None
            quarantine_tripped = judge_quarantine(self._share[0], self.config) is not None
            status = self._status if error else dataclasses.replace(self._status, drained_nodes=int(drained))
            self._status = dataclasses.replace(status, tripped=self._drain_tripped or quarantine_tripped)
        return self._verdict("drain", refusal)

    def _drained_now(self, deadline_s: float) -> float:
        return self.prometheus.scalar(drained_nodes_query(self.config.window_s), deadline_s)

    def _share_now(self, deadline_s: float) -> float:
        share = self.prometheus.scalar(QUARANTINED_SHARE, deadline_s)
        if share > 1.0:
            raise FleetError(f"{self.prometheus.url}: a quarantined share of {share} is more than the whole fleet")
        return share

    def _verdict(self, what: str, refusal: str | None) -> str | None:
        with self._lock:
            new = refusal is not None and what not in self._refused
            if refusal is None:
                self._refused.discard(what)
            else:
                self._refused.add(what)
            self._status = dataclasses.replace(self._status, refusals_total=self._status.refusals_total + new)
        return refusal

    def _ask(self, query: Callable[[float], float]) -> tuple[float, str]:
        """(value, "") of one ask within `timeout_s`, or (0, the error): any error counts as unreachable, and is
        logged when Prometheus stops (and starts again) answering."""
        value = 0.0
        try:
            value = query(self.config.timeout_s)
            error = ""
        except FleetError as exc:
            error = str(exc)
        except Exception as exc:  # whatever else a peer makes go wrong counts as unreachable too, never as an answer
            error = f"{self.prometheus.url}: {type(exc).__name__}: {exc}"
        with self._lock:
            was = self._status
            failures = was.query_failures_total + bool(error)
            self._status = dataclasses.replace(was, reachable=not error, query_failures_total=failures)
        if error and was.reachable:
            fallback = "refusing" if self.config.on_unreachable == "closed" else "the node breaker alone decides"
            log.warning("fleet breaker: cannot ask Prometheus: %s; %s until it answers", error, fallback)
        elif not error and not was.reachable:
            log.warning("fleet breaker: Prometheus answers again")
        return value, error
