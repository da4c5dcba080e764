"""The trainer and incident metric families, from remediation's last judgement and incident record.

Labels follow docs/metrics.md: `gpu`, `uuid`, plus `rank` and `job_id` (not `job`: Prometheus' own target
label would win over it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.health import trainer_rules
from gpuwatch.node.ranks import Rank
from gpuwatch.remediation import Remediation

LABELS = ["gpu", "uuid", "rank", "job_id"]


class RemediationCollector(Collector):
    """gpuwatch_trainer_* per rank and job, gpuwatch_incident* of the latest incident with trainers."""

    def __init__(self, remediation: Remediation) -> None:
        self.remediation = remediation

    def collect(self) -> Iterator[Metric]:
        ranks, verdict = self.remediation.ranks()
        total, last = self.remediation.incidents.latest()
        yield from _rank_families(ranks, verdict)
        variance = GaugeMetricFamily(
            "gpuwatch_trainer_grad_norm_variance",
            "Variance of the job's gradient norm over its last 100 steps (a job is its id and its user).",
            labels=["job_id", "uid"],
        )
        for (job, uid), value in _job_variances(ranks).items():
            variance.add_metric([job, uid], value)
        yield variance
        yield CounterMetricFamily("gpuwatch_incidents", "Quarantines handled as incidents (stored).", value=total)
        yield CounterMetricFamily(
            "gpuwatch_incidents_refused",
            "Incidents a user's own ranks opened beyond their budget (stopped, not recorded).",
            value=self.remediation.incidents.refused,
        )
        for name, key, text in (
            ("gpuwatch_incident_time_to_stop_seconds", "time_to_stop_s", "decision to the last rank gone"),
            ("gpuwatch_incident_time_to_resume_seconds", "time_to_resume_s", "decision to the first step resumed"),
            ("gpuwatch_incident_steps_lost", "steps_lost", "steps redone after the resume"),
        ):
            family = GaugeMetricFamily(name, f"Latest incident with trainers: {text}.")
            if last is not None and last.get(key) is not None:
                family.add_metric([], float(last[key]))
            yield family


def _rank_families(ranks: Sequence[Rank], verdict: trainer_rules.Verdict) -> Iterator[Metric]:
    frag = GaugeMetricFamily(
        "gpuwatch_trainer_memory_fragmentation_ratio",
        "(reserved - allocated) / reserved of the rank's CUDA caching allocator.",
        labels=LABELS,
    )
    step = GaugeMetricFamily("gpuwatch_trainer_step_time_seconds", "Mean step time the rank reports.", labels=LABELS)
    retries = CounterMetricFamily(
        "gpuwatch_trainer_alloc_retries",
        "cudaMalloc retries after a cache flush (num_alloc_retries).",
        labels=LABELS,
    )
    straggler = GaugeMetricFamily(
        "gpuwatch_trainer_straggler",
        "1 when the rank's step time is trainer.straggler_ratio above its peers' median; gpu_throttling: a fault "
        "reason bit is active on its GPU.",
        labels=[*LABELS, "gpu_throttling"],
    )
    seen: set[tuple[str, ...]] = set()
    checks = {c.trainer.pid: c for c in verdict.stragglers}
    for rank in ranks:
        labels = _labels(rank)
        if labels in seen:
            continue  # two unnamed processes on one GPU: one series, never a duplicate
        seen.add(labels)
        info = rank.info
        ratio = trainer_rules.fragmentation_ratio(info)
        if ratio is not None:
            frag.add_metric(list(labels), ratio)
        if info.step_time_s is not None:
            step.add_metric(list(labels), info.step_time_s)
        if info.num_alloc_retries is not None:
            retries.add_metric(list(labels), info.num_alloc_retries)
        check = checks.get(info.pid)
        if check is not None:
            straggler.add_metric([*labels, "true" if check.throttling else "false"], int(check.straggler))
    yield from (frag, step, straggler, retries)


def _labels(rank: Rank) -> tuple[str, str, str, str]:
    info = rank.info
    gpu = "" if rank.gpu is None else str(rank.gpu)
    return gpu, info.gpu_uuid or "", "" if info.rank is None else str(info.rank), info.job_id or ""


def _job_variances(ranks: Sequence[Rank]) -> dict[tuple[str, str], float]:
    """Per job (id, uid), the lowest rank's grad-norm variance (DDP ranks all-reduce gradients: they agree)."""
    values: dict[tuple[str, str], tuple[int, float]] = {}
    for rank in ranks:
        info = rank.info
        if info.grad_norm_var is None:
            continue
        order = info.rank if info.rank is not None else 1 << 30
        job = (info.job_id or "", "" if rank.uid is None else str(rank.uid))
        if job not in values or order < values[job][0]:
            values[job] = (order, info.grad_norm_var)
    return {job: value for job, (_, value) in values.items()}
