"""metrics.text_exposition writes exactly what prometheus_client's generate_latest writes; the renderer
renders ahead only for scrapers that read every Snapshot."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.serving.metrics import MetricsRenderer, SnapshotCollector, text_exposition


class Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def plain() -> list[Metric]:
    gauge = GaugeMetricFamily("gpuwatch_gpu_info", "Doc with a \\ backslash\nand a newline.", labels=["gpu", "name"])
    gauge.add_metric(["0", 'NVIDIA "H200" \\ 141GB\nHBM3e'], 1)
    gauge.add_metric(["1", "ünïcode"], 0.1 + 0.2)
    gauge.add_metric(["2", "big"], 123456789012.0)
    gauge.add_metric(["3", "inf"], float("inf"))
    counter = CounterMetricFamily("gpuwatch_samples", "Rounds.", labels=["backend"])
    counter.add_metric(["sim"], 42)
    bare = GaugeMetricFamily("gpuwatch_gpus", "GPUs.", value=8)
    empty = GaugeMetricFamily("gpuwatch_gpu_read_error", "None now.", labels=["gpu"])
    return [gauge, counter, bare, empty]


def test_plain_gauges_and_counters_match_byte_for_byte() -> None:
    families = plain()
    assert text_exposition(families) == generate_latest(Families(families))


def test_anything_else_goes_through_generate_latest() -> None:
    histogram = HistogramMetricFamily(
        "gpuwatch_scrape_seconds", "Scrapes.", buckets=[("1.0", 3), ("+Inf", 4)], sum_value=2
    )
    created = CounterMetricFamily("gpuwatch_runs", "Runs.", value=3, created=1700000000.0)
    stamped = GaugeMetricFamily("gpuwatch_stamped", "Stamped.", labels=["gpu"])
    stamped.add_metric(["0"], 1, timestamp=1700000000.5)
    for odd in (histogram, created, stamped):
        families = [*plain(), odd]
        assert text_exposition(families) == generate_latest(Families(families)), odd.name


class CountingCollector(SnapshotCollector):
    def __init__(self) -> None:
        super().__init__(lambda: None)  # type: ignore[arg-type,return-value]  # collect() is overridden
        self.collected = 0

    def collect(self) -> Iterator[Metric]:
        self.collected += 1
        return iter(plain())


def test_prerender_renders_ahead_only_while_every_snapshot_is_read() -> None:
    collector, version = CountingCollector(), [0]
    renderer = MetricsRenderer(collector, key=lambda: version[0])
    renderer.prerender()
    assert collector.collected == 0  # nobody has scraped: nothing to render ahead for
    assert renderer.render() == generate_latest(Families(plain()))
    assert collector.collected == 1
    version[0] += 1  # a new Snapshot, and the last body was read: render it now, not in the next scrape
    renderer.prerender()
    assert collector.collected == 2
    renderer.render()
    assert collector.collected == 2  # the scrape got the bytes rendered ahead
    version[0] += 1
    renderer.prerender()
    version[0] += 1
    renderer.prerender()  # the body rendered ahead was never read: a slow scraper renders on demand
    assert collector.collected == 3
    renderer.render()
    assert collector.collected == 4
