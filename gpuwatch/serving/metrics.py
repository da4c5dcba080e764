"""Prometheus metrics built from the Snapshot at scrape time, rendered once per Snapshot.

A scrape never calls NVML: it reads the last Snapshot, and the text exposition is cached
until the Snapshot (or a drill/incident record) changes, so concurrent scrapes cost a dict
lookup. Names follow docs/metrics.md (Prometheus's naming practices): base units, `_total` on counters,
labels `gpu` and `uuid`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpuwatch import __version__
from gpuwatch.model import REASON_NAMES, GpuStatus, Health, Snapshot

MHZ = 1_000_000.0


def _drill(flag: bool) -> str:
    return "true" if flag else "false"


class SnapshotCollector(Collector):
    """Yields the node and per-GPU gpuwatch_* families from the current Snapshot."""

    def __init__(self, snapshot: Callable[[], Snapshot], expected_gpus: int = 0) -> None:
        self._snapshot = snapshot
        self._expected_gpus = expected_gpus

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from self._node(snap)
        yield from self._gpus(snap.gpus)

    def _node(self, snap: Snapshot) -> Iterator[Metric]:
        build = GaugeMetricFamily("gpuwatch_build_info", "gpuwatch version and backend.", labels=["version", "backend"])
        build.add_metric([__version__, snap.backend], 1)
        yield build
        yield GaugeMetricFamily("gpuwatch_gpus", "GPUs this daemon watches.", value=len(snap.gpus))
        yield GaugeMetricFamily(
            "gpuwatch_gpus_expected",
            "GPUs this node should have (config expected_gpus, else the count seen at start).",
            value=self._expected_gpus or len(snap.gpus),
        )
        labels = ["backend"]
        duration = GaugeMetricFamily(
            "gpuwatch_sample_duration_seconds", "Wall time of the last full sample of all GPUs.", labels=labels
        )
        duration.add_metric([snap.backend], snap.sample_duration_s)
        yield duration
        errors_now = sum(1 for g in snap.gpus if g.error is not None)
        success = GaugeMetricFamily("gpuwatch_sample_success", "1 if every GPU read fine last sample.", labels=labels)
        success.add_metric([snap.backend], 0 if errors_now else 1)
        yield success
        samples = CounterMetricFamily("gpuwatch_samples", "Sampling rounds since start.", labels=labels)
        samples.add_metric([snap.backend], snap.samples_total)
        yield samples
        sample_errors = CounterMetricFamily("gpuwatch_sample_errors", "GPU reads that failed.", labels=labels)
        sample_errors.add_metric([snap.backend], snap.sample_errors_total)
        yield sample_errors
        yield GaugeMetricFamily(
            "gpuwatch_last_sample_timestamp_seconds", "When the last Snapshot was judged.", value=snap.t
        )
        yield GaugeMetricFamily(
            "gpuwatch_breaker_tripped",
            "1 while the circuit breaker refuses further automatic quarantines.",
            value=int(snap.breaker_tripped),
        )
        yield CounterMetricFamily(
            "gpuwatch_breaker_refusals",
            "Automatic quarantines refused by the circuit breaker.",
            value=snap.breaker_refusals_total,
        )
        yield GaugeMetricFamily(
            "gpuwatch_store_degraded",
            "1 while the state store cannot write: quarantine changes are in force, kept in its journal until it can.",
            value=int(bool(snap.store_error)),
        )
        yield GaugeMetricFamily(
            "gpuwatch_store_unsaved_changes",
            "Quarantine changes in force but not yet durable.",
            value=snap.store_unsaved,
        )
        yield CounterMetricFamily(
            "gpuwatch_store_write_errors", "Failed writes to the state store.", value=snap.store_write_errors_total
        )
        if snap.kernel_log_readable is not None:  # followed only on live backends
            yield GaugeMetricFamily(
                "gpuwatch_kernel_log_readable",
                "1 if the kernel log (XIDs from before the daemon started) can be read.",
                value=int(snap.kernel_log_readable),
            )
            yield CounterMetricFamily(
                "gpuwatch_kernel_sxid_errors", "NVSwitch SXid lines in the kernel log.", value=snap.kernel_sxids_total
            )

    def _gpus(self, gpus: tuple[GpuStatus, ...]) -> Iterator[Metric]:
        g_labels = ["gpu", "uuid"]
        info = GaugeMetricFamily(
            "gpuwatch_gpu_info", "Static facts of each GPU.", labels=[*g_labels, "name", "pci_bus_id"]
        )
        health = GaugeMetricFamily(
            "gpuwatch_gpu_health_state", "1 on the GPU's current health state.", labels=[*g_labels, "state", "drill"]
        )
        quarantined = GaugeMetricFamily(
            "gpuwatch_gpu_quarantined", "1 if the GPU is quarantined.", labels=[*g_labels, "drill"]
        )
        finding = GaugeMetricFamily(
            "gpuwatch_gpu_finding",
            "1 for each active finding of a rule on the GPU.",
            labels=[*g_labels, "rule", "severity", "action", "drill"],
        )
        read_error = GaugeMetricFamily(
            "gpuwatch_gpu_read_error", "1 if the last read of the GPU failed, by kind.", labels=[*g_labels, "kind"]
        )
        last_sample = GaugeMetricFamily(
            "gpuwatch_gpu_last_sample_timestamp_seconds", "When the GPU was last read fine.", labels=g_labels
        )
        epoch = GaugeMetricFamily("gpuwatch_gpu_quarantine_epoch", "Grows with every quarantine.", labels=g_labels)
        reasons = GaugeMetricFamily(
            "gpuwatch_gpu_clocks_event_active", "1 per active NVML clocks-event reason.", labels=[*g_labels, "reason"]
        )
        xid = CounterMetricFamily("gpuwatch_gpu_xid_errors", "XID events seen since start.", labels=[*g_labels, "xid"])
        gauges = {name: GaugeMetricFamily(name, doc, labels=g_labels) for name, doc in _GAUGE_DOCS.items()}
        ecc = CounterMetricFamily(
            "gpuwatch_gpu_ecc_errors", "ECC errors (aggregate, lifetime of the card).", labels=[*g_labels, "type"]
        )
        remapped = CounterMetricFamily("gpuwatch_gpu_remapped_rows", "Rows remapped.", labels=[*g_labels, "type"])
        counters = {name: CounterMetricFamily(name, doc, labels=g_labels) for name, doc in _COUNTER_DOCS.items()}
        violation = CounterMetricFamily(
            "gpuwatch_gpu_violation_seconds", "Time clocks were held down, by cause.", labels=[*g_labels, "type"]
        )
        for g in gpus:
            ids = [str(g.index), g.uuid]
            info.add_metric([*ids, g.static.name, g.static.pci_bus_id], 1)
            for h in Health:
                health.add_metric([*ids, h.value, _drill(g.drill_active)], 1 if g.state is h else 0)
            quarantined.add_metric([*ids, _drill(g.drill_active)], 1 if g.quarantined else 0)
            epoch.add_metric(ids, g.epoch)
            for f in g.findings:
                finding.add_metric([*ids, f.rule, f.severity.value, f.action.value, _drill(f.drill)], 1)
            if g.error is not None:
                read_error.add_metric([*ids, g.error.kind], 1)
            for number, count in g.xid_counts:
                xid.add_metric([*ids, str(number)], count)
            _static_gauges(gauges, ids, g)
            s = g.sample
            if s is None:
                continue
            last_sample.add_metric(ids, s.t)
            if s.clocks_event_reasons is not None:
                for bit, name in REASON_NAMES.items():
                    reasons.add_metric([*ids, name], 1 if s.clocks_event_reasons & bit else 0)
            for name, value in (
                ("gpuwatch_gpu_sm_clock_hertz", _scale(s.sm_clock_mhz, MHZ)),
                ("gpuwatch_gpu_memory_clock_hertz", _scale(s.mem_clock_mhz, MHZ)),
                ("gpuwatch_gpu_power_watts", s.power_w),
                ("gpuwatch_gpu_temperature_celsius", s.temp_c),
                ("gpuwatch_gpu_memory_temperature_celsius", s.mem_temp_c),
                ("gpuwatch_gpu_utilization_ratio", _scale(s.util_gpu_pct, 0.01)),
                ("gpuwatch_gpu_memory_utilization_ratio", _scale(s.util_mem_pct, 0.01)),
                ("gpuwatch_gpu_memory_used_bytes", s.memory_used_bytes),
                ("gpuwatch_gpu_pstate", s.pstate),
                ("gpuwatch_gpu_row_remap_pending", s.remapped_pending),
                ("gpuwatch_gpu_row_remap_failed", s.remapped_failure),
                ("gpuwatch_gpu_processes", len(s.pids)),
                ("gpuwatch_gpu_pcie_link_generation", s.pcie_link_gen),
                ("gpuwatch_gpu_pcie_link_width", s.pcie_link_width),
                ("gpuwatch_gpu_recovery_action", s.recovery_action),
                ("gpuwatch_gpu_nvlink_down", s.nvlink_links_down),
                ("gpuwatch_gpu_fabric_state", s.fabric_state),
            ):
                if value is not None:
                    gauges[name].add_metric(ids, value)
            for kind, value in (("correctable", s.ecc_sbe_aggregate), ("uncorrectable", s.ecc_dbe_aggregate)):
                if value is not None:
                    ecc.add_metric([*ids, kind], value)
            for kind, value in (("correctable", s.remapped_cor), ("uncorrectable", s.remapped_unc)):
                if value is not None:
                    remapped.add_metric([*ids, kind], value)
            for name, value in (
                ("gpuwatch_gpu_energy_joules", _scale(s.energy_mj, 0.001)),
                ("gpuwatch_gpu_pcie_replay", s.pcie_replay),
                ("gpuwatch_gpu_pcie_correctable_errors", s.pcie_correctable_errors),
                ("gpuwatch_gpu_nvlink_crc_errors", s.nvlink_crc_errors),
                ("gpuwatch_gpu_nvlink_recovery_errors", s.nvlink_recovery_errors),
            ):
                if value is not None:
                    counters[name].add_metric(ids, value)
            for kind, value in (("power", s.violation_power_ns), ("thermal", s.violation_thermal_ns)):
                if value is not None:
                    violation.add_metric([*ids, kind], value / 1e9)
        yield from (info, health, quarantined, epoch, finding, read_error, last_sample, reasons, xid)
        yield from gauges.values()
        yield from (ecc, remapped, violation)
        yield from counters.values()


_GAUGE_DOCS = {
    "gpuwatch_gpu_sm_clock_hertz": "Current SM clock.",
    "gpuwatch_gpu_sm_clock_max_hertz": "Maximum SM clock.",
    "gpuwatch_gpu_memory_clock_hertz": "Current memory clock.",
    "gpuwatch_gpu_power_watts": "Power draw.",
    "gpuwatch_gpu_power_limit_watts": "Enforced power limit.",
    "gpuwatch_gpu_temperature_celsius": "GPU temperature.",
    "gpuwatch_gpu_memory_temperature_celsius": "HBM temperature.",
    "gpuwatch_gpu_slowdown_temperature_celsius": "Temperature at which the GPU slows down.",
    "gpuwatch_gpu_utilization_ratio": "Share of time a kernel ran (NVML utilization).",
    "gpuwatch_gpu_memory_utilization_ratio": "Share of time memory was read or written.",
    "gpuwatch_gpu_memory_used_bytes": "Framebuffer memory used.",
    "gpuwatch_gpu_memory_total_bytes": "Framebuffer memory in all.",
    "gpuwatch_gpu_pstate": "Performance state (0 is fastest).",
    "gpuwatch_gpu_row_remap_pending": "1 if a row remap waits for a GPU reset.",
    "gpuwatch_gpu_row_remap_failed": "1 if a row remap failed.",
    "gpuwatch_gpu_processes": "Compute processes on the GPU.",
    "gpuwatch_gpu_pcie_link_generation": "Current PCIe link generation.",
    "gpuwatch_gpu_pcie_link_generation_max": "Highest PCIe generation the GPU and its slot allow.",
    "gpuwatch_gpu_pcie_link_width": "Current PCIe link width (lanes).",
    "gpuwatch_gpu_pcie_link_width_max": "Widest PCIe link the GPU and its slot allow (lanes).",
    "gpuwatch_gpu_recovery_action": "Driver recovery action: 0 none, 1 GPU reset, 2 reboot, 3/4 drain (and reset).",
    "gpuwatch_gpu_nvlink_down": "NVLinks not active (absent on a GPU without NVLink).",
    "gpuwatch_gpu_fabric_state": "NVSwitch fabric registration state (3 completed; absent without a fabric).",
}
_COUNTER_DOCS = {
    "gpuwatch_gpu_energy_joules": "Energy used since the driver loaded.",
    "gpuwatch_gpu_pcie_replay": "PCIe replays.",
    "gpuwatch_gpu_pcie_correctable_errors": "PCIe correctable errors.",
    "gpuwatch_gpu_nvlink_crc_errors": "NVLink CRC flit errors, all links.",
    "gpuwatch_gpu_nvlink_recovery_errors": "NVLink recovery errors, all links.",
}


def _scale(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _static_gauges(gauges: dict[str, GaugeMetricFamily], ids: list[str], g: GpuStatus) -> None:
    st = g.static
    for name, value in (
        ("gpuwatch_gpu_sm_clock_max_hertz", _scale(st.max_sm_clock_mhz, MHZ)),
        ("gpuwatch_gpu_power_limit_watts", st.power_limit_w),
        ("gpuwatch_gpu_memory_total_bytes", st.memory_total_bytes),
        ("gpuwatch_gpu_slowdown_temperature_celsius", st.slowdown_temp_c),
        ("gpuwatch_gpu_pcie_link_generation_max", st.pcie_link_gen_max),
        ("gpuwatch_gpu_pcie_link_width_max", st.pcie_link_width_max),
    ):
        if value is not None:
            gauges[name].add_metric(ids, value)


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def text_exposition(families: Iterable[Metric]) -> bytes:
    """What prometheus_client's generate_latest writes, byte for byte, in a third of its time.

    generate_latest re-validates and re-escapes every label name of every sample; gpuwatch's families are
    plain gauges and counters with fixed, valid names, so this checks each name once per family and
    formats the values with the client's own floatToGoString. Any other family (a type, a timestamp or
    a name this does not know) sends the whole exposition through generate_latest.
    """
    collected = list(families)
    if not all(_plain(metric) for metric in collected):
        return generate_latest(_Fixed(collected))
    out: list[str] = []
    for metric in collected:
        name = metric.name + "_total" if metric.type == "counter" else metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        for sample in metric.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
                out.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n")
            else:
                out.append(f"{sample.name} {floatToGoString(sample.value)}\n")
    return "".join(out).encode("utf-8")


def _plain(metric: Metric) -> bool:
    """A gauge or counter whose samples text_exposition writes exactly as generate_latest would."""
    if metric.type not in ("gauge", "counter") or not _METRIC_NAME.fullmatch(metric.name):
        return False
    sample_name = metric.name + "_total" if metric.type == "counter" else metric.name
    label_names: set[str] = set()
    for sample in metric.samples:
        if sample.name != sample_name or sample.timestamp is not None or sample.exemplar or sample.native_histogram:
            return False
        label_names.update(sample.labels)
    return all(_LABEL_NAME.fullmatch(label) for label in label_names)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Fixed(Collector):
    """Already collected families, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class MetricsRenderer:
    """Renders the exposition text once per distinct state and serves the cached bytes.

    `render` is what a scrape calls. `prerender` is what the sampling thread calls after each Snapshot:
    it renders ahead only while scrapes read every Snapshot (the last body rendered was served), so
    back-to-back scrapers never wait for a render while a Prometheus scraping every 15 s at a 1 s
    interval does not pay fifteen renders for the one it reads.
    """

    def __init__(self, *collectors: Collector, key: Callable[[], Hashable]) -> None:
        """One Collector per concern, exposed in the order given; `key` changes whenever any of them would."""
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in collectors:
            self.registry.register(collector)
        self._key = key
        self._lock = threading.Lock()
        self._cached: tuple[Hashable, bytes] | None = None
        self._served = False  # the cached body went out to a scrape

    def render(self) -> bytes:
        self._served = True
        return self._body()

    def prerender(self) -> None:
        if self._served:
            self._served = False
            self._body()

    def _body(self) -> bytes:
        key = self._key()
        cached = self._cached
        if cached is not None and cached[0] == key:
            return cached[1]
        with self._lock:
            cached = self._cached
            if cached is not None and cached[0] == key:
                return cached[1]
            body = text_exposition(self.registry.collect())
            self._cached = (key, body)
            return body
