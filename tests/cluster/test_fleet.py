"""gpuwatch/cluster/fleet.py: the verdicts, the Prometheus query and its failures, caching, counting, the collector.

A real Prometheus runs in tests/e2e/test_fleet_breaker.py; here a small HTTP server answers with
what Prometheus' query API returns, including the answers it gives when something is wrong.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwatch.base.clock import ManualClock
from gpuwatch.cluster.fleet import (
    DRAINED_NODES_1H_QUERY,
    JITTER,
    MAX_ANSWER_BYTES,
    QUARANTINED_SHARE,
    FleetBreaker,
    FleetCollector,
    FleetError,
    FleetStatus,
    FleetView,
    Prometheus,
    drained_nodes_query,
    judge_drain,
    judge_quarantine,
)
from gpuwatch.cluster.slurm import DrainStatus, SlurmCollector
from gpuwatch.config import FleetConfig
from gpuwatch.testing.daemon_process import free_port, wait_until
from tests.bad_prometheus import HUGE_BYTES, BadPrometheus

LIMITS = FleetConfig(prometheus_url="http://x", max_quarantined_share=0.2, max_drained_nodes=3)


def test_verdicts() -> None:
    assert judge_quarantine(FleetView(0.19, 9), LIMITS) is None
    assert judge_quarantine(FleetView(0.25, 0), LIMITS) == (
        "25.0% of the fleet's GPUs are quarantined, at or above fleet.max_quarantined_share 20.0%"
    )
    assert judge_drain(FleetView(0.9, 2), LIMITS) is None
    assert judge_drain(FleetView(0.0, 3), LIMITS) == (
        "3 node(s) drained by gpuwatch in the last 3600 s, at or above fleet.max_drained_nodes 3"
    )
    down = FleetView(error="connection refused")
    assert judge_quarantine(down, LIMITS) is None and judge_drain(down, LIMITS) is None  # open: the node decides
    closed = FleetConfig(on_unreachable="closed")
    assert judge_quarantine(down, closed) == (
        "Prometheus cannot be asked (connection refused) and fleet.on_unreachable is closed"
    )


class FakePrometheus:
    """Answers /api/v1/query from a dict of query → response body; records the queries."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {}
        self.queries: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
                owner.queries.append(query)
                body = json.dumps(owner.answers.get(query, {"status": "success", "data": {"result": []}})).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, query: str, value: float) -> None:
        self.answers[query] = {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, str(value)]}]},
        }


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    yield fake
    fake.server.shutdown()


def test_scalar_and_its_failures(prometheus: FakePrometheus) -> None:
    client = Prometheus(prometheus.url + "/", 1.0)
    prometheus.answer("up", 0.5)
    assert client.scalar("up") == 0.5
    with pytest.raises(FleetError, match=r"returned 0 series, not 1 \(recording rules loaded\?\)"):
        client.scalar(QUARANTINED_SHARE)
    prometheus.answers["bad"] = {"status": "error", "error": "parse error"}
    with pytest.raises(FleetError, match="query 'bad' failed"):
        client.scalar("bad")
    closed_port = free_port()
    with pytest.raises(FleetError, match=f"^http://127.0.0.1:{closed_port}: .*Connection refused"):
        Prometheus(f"http://127.0.0.1:{closed_port}", 0.5).scalar("up")


def test_breaker_judges_on_its_last_reading_counts_each_refused_gpu_once_and_lets_go(
    prometheus: FakePrometheus,
) -> None:
    clock = ManualClock(0)
    config = FleetConfig(prometheus_url=prometheus.url, max_quarantined_share=0.2, cache_s=5)
    breaker = FleetBreaker(config, clock=clock)
    prometheus.answer(QUARANTINED_SHARE, 0.25)
    prometheus.answer(drained_nodes_query(config.window_s), 1)
    breaker.refresh()
    assert breaker.allow_quarantine(1, "xid") is not None
    assert breaker.allow_quarantine(1, "xid") is not None
    assert breaker.allow_quarantine(2, "xid") is not None
    assert prometheus.queries == [QUARANTINED_SHARE]  # one reading served all three: a quarantine never asks
    assert breaker.allow_drain() is None
    assert prometheus.queries[1:] == [drained_nodes_query(config.window_s)]  # a drain asks, on its own thread
    assert breaker.status() == FleetStatus(quarantined_share=0.25, drained_nodes=1, tripped=True, refusals_total=2)
    prometheus.answer(QUARANTINED_SHARE, 0.1)
    assert breaker.allow_quarantine(1, "xid") is not None, "still the last reading: a decision never waits"
    breaker.refresh()
    assert breaker.allow_quarantine(1, "xid") is None
    assert breaker.allow_quarantine(2, "xid") is None
    assert breaker.status() == FleetStatus(quarantined_share=0.1, drained_nodes=1, tripped=False, refusals_total=2)


def test_the_share_is_read_every_cache_s_from_a_thread_of_its_own(prometheus: FakePrometheus) -> None:
    config = FleetConfig(prometheus_url=prometheus.url, max_quarantined_share=0.2, cache_s=1)
    breaker = FleetBreaker(config)
    prometheus.answer(QUARANTINED_SHARE, 0.25)
    breaker.start()
    try:
        assert prometheus.queries == [QUARANTINED_SHARE], "read once at start, before the first decision"
        assert breaker.allow_quarantine(0, "xid") is not None
        prometheus.answer(QUARANTINED_SHARE, 0.0)
        wait_until("read again and let go", lambda: breaker.allow_quarantine(0, "xid") is None, timeout_s=5)
    finally:
        breaker.stop()


def test_a_fleet_of_nodes_asks_precomputed_numbers_and_drifts_apart(prometheus: FakePrometheus) -> None:
    """The drained count over the default hour is the recording rule (not every node's max_over_time of every
    node's hour), and the reads are spread: nodes started together do not ask in step for ever."""
    config = FleetConfig(prometheus_url=prometheus.url)
    assert drained_nodes_query(config.window_s) == DRAINED_NODES_1H_QUERY
    assert "max_over_time" in drained_nodes_query(600)  # another window: the query itself
    prometheus.answer(DRAINED_NODES_1H_QUERY, 2)
    breaker = FleetBreaker(config)
    assert breaker.allow_drain() is None and prometheus.queries == [DRAINED_NODES_1H_QUERY]
    periods = [FleetBreaker(config).period_s for _ in range(200)]
    assert all(config.cache_s <= p <= config.cache_s * (1 + JITTER) for p in periods)
    assert max(periods) - min(periods) > config.cache_s * JITTER / 2, "every node reads at the same period"


def test_a_reading_the_thread_stopped_renewing_counts_as_unreachable(prometheus: FakePrometheus) -> None:
    clock = ManualClock(0)
    config = FleetConfig(prometheus_url=prometheus.url, max_quarantined_share=0.2, on_unreachable="closed")
    breaker = FleetBreaker(config, clock=clock)
    prometheus.answer(QUARANTINED_SHARE, 0.0)
    assert "not asked yet" in (breaker.allow_quarantine(0, "xid") or "")
    breaker.refresh()
    assert breaker.allow_quarantine(0, "xid") is None
    clock.advance(60)
    assert "no answer from Prometheus for 60 s" in (breaker.allow_quarantine(0, "xid") or "")


def test_unreachable_open_and_closed(caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    opened = FleetBreaker(FleetConfig(prometheus_url=url, timeout_s=0.5, cache_s=0))
    opened.refresh()
    assert opened.allow_quarantine(0, "xid") is None
    assert opened.status() == FleetStatus(reachable=False, query_failures_total=1)
    opened.refresh()
    assert opened.allow_quarantine(0, "xid") is None
    assert opened.status() == FleetStatus(reachable=False, query_failures_total=2)
    said = [r.getMessage() for r in caplog.records if "cannot ask Prometheus" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("the node breaker alone decides until it answers")  # once, not per ask
    closed = FleetBreaker(FleetConfig(prometheus_url=url, timeout_s=0.5, on_unreachable="closed"))
    closed.refresh()
    assert "fleet.on_unreachable is closed" in (closed.allow_drain() or "")
    assert closed.status().tripped and closed.status().refusals_total == 1


@pytest.mark.parametrize(
    ("mode", "value", "said"),
    [
        ("ok", "NaN", "nan is not a finite, non-negative number"),
        ("ok", "+Inf", "inf is not a finite, non-negative number"),
        ("ok", "-Inf", "-inf is not a finite, non-negative number"),
        ("ok", "-3", "-3.0 is not a finite, non-negative number"),
        ("ok", "1.5", "a quarantined share of 1.5 is more than the whole fleet"),
        ("deep", "", "JSON nested deeper than 16 levels"),
        ("trickle", "", "no whole answer within 1 s"),
        ("huge", "", f"an answer of {HUGE_BYTES} bytes, over the limit of {MAX_ANSWER_BYTES}"),
        ("huge_unsized", "", f"an answer of more than {MAX_ANSWER_BYTES} bytes"),
    ],
)
@pytest.mark.slow
def test_a_bad_answer_is_unreachable_within_the_deadline_and_the_size_limit(mode: str, value: str, said: str) -> None:
    with BadPrometheus(mode, value) as bad:
        breaker = FleetBreaker(FleetConfig(prometheus_url=bad.url, timeout_s=1.0, on_unreachable="closed"))
        started = time.monotonic()
        view = breaker.refresh()
        took = time.monotonic() - started
        assert said in view.error, view.error
        assert took < 1.5, f"{mode}: {took:.2f} s, over the deadline of 1 s"
        assert bad.sent_bytes < 16 * MAX_ANSWER_BYTES, f"{mode}: the server got to send {bad.sent_bytes} bytes"
        assert breaker.status().query_failures_total == 1 and not breaker.status().reachable
        assert "fleet.on_unreachable is closed" in (breaker.allow_quarantine(0, "xid") or "")
        if value != "1.5":  # a drain's ask of the drained count meets the same limits
            started = time.monotonic()
            assert "fleet.on_unreachable is closed" in (breaker.allow_drain() or "")
            assert time.monotonic() - started < 1.5 and breaker.status().query_failures_total == 2


def test_collector_exports_exact_values_on_a_fresh_registry() -> None:
    status = FleetStatus(False, 0.25, 4, True, 3, 7)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: status))
    names = [
        "gpuwatch_fleet_prometheus_up",
        "gpuwatch_fleet_quarantined_ratio",
        "gpuwatch_fleet_drained_nodes",
        "gpuwatch_fleet_breaker_tripped",
        "gpuwatch_fleet_breaker_refusals_total",
        "gpuwatch_fleet_query_failures_total",
    ]
    assert [registry.get_sample_value(n) for n in names] == [0.0, 0.25, 4.0, 1.0, 3.0, 7.0]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_check_metrics_is_clean_for_the_slurm_and_fleet_families() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(FleetStatus))
    registry.register(SlurmCollector(DrainStatus))
    text = generate_latest(registry).decode()
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr
    assert text.count("# TYPE gpuwatch_") == 14
