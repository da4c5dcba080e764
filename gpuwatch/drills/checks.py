"""What must follow a fault, step by step: the finding, the metric an alert fires on, the quarantine,
the trainers stopping with a checkpoint, the job resuming, and the release after burn-in.

Trainer steps read GET /v1/incidents (the remediation's record of each stop-and-resume); they skip
with "no trainer on GPU N" when none ran there, and when the finding quarantines nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.drills.daemon_client import gpu, incidents
from gpuwatch.drills.run_state import Run
from gpuwatch.drills.spec import InjectSpec
from gpuwatch.drills.steps import Outcome, Pending, Skip, Step
from gpuwatch.errors import DrillError
from gpuwatch.model import Severity

if TYPE_CHECKING:  # pydantic loads with the first answer read, not with the daemon that imports the drills
    from gpuwatch.serving import wire

_BAD = (Severity.DEGRADED.value, Severity.UNHEALTHY.value)


def after_fault(run: Run) -> list[Step]:
    """The chain every fault drill checks, in order."""
    return [finding(run), alert_metric(run), quarantined(run), *trainer_steps(run), released(run)]


def _finding_deadline(run: Run) -> float:
    """`within=` when given, else the rule window's lag plus the time to see it (at once for events)."""
    drills = run.config.drills
    spec_within = getattr(run.spec, "within_s", None)
    if spec_within:
        return float(spec_within)
    if run.expect.event:
        return run.expect.lag_s + drills.event_detect_timeout_s
    return run.expect.lag_s + run.config.interval_s + drills.detect_timeout_s


def finding(run: Run) -> Step:
    rules = run.expect.rules
    wanted = " or ".join(rules) or "any finding"

    def check() -> Outcome:
        findings = gpu(run.api, run.gpu).findings
        hits = [f for f in findings if f.drill and (not rules or f.rule in rules)]
        if hits:
            run.finding = hits[0]
            f = hits[0]
            return f"{f.rule} ({f.severity}, action {f.action}): {f.reason}"
        seen = ", ".join(f.rule + ("" if f.drill else " (not drill)") for f in findings)
        return Pending(f"GPU {run.gpu} findings: {seen or 'none'}")

    deadline = _finding_deadline(run)
    return Step("finding", f"wait up to {deadline:g} s for {wanted} marked drill on GPU {run.gpu}", check, deadline)


def alert_metric(run: Run) -> Step:
    """The series the alert rules fire on, as a scrape sees them, with drill="true" for the router."""

    def check() -> Outcome:
        f = _found(run)
        series = _series(run.api.text("/metrics"))
        labels = {"gpu": str(run.gpu), "drill": "true"}
        shown = _show("gpuwatch_gpu_finding", {**labels, "rule": f.rule})
        if _value(series, "gpuwatch_gpu_finding", {**labels, "rule": f.rule}) != 1:
            return Pending(f"/metrics lacks {shown} 1")
        if f.severity not in _BAD:
            return f"{shown} 1"
        for state in _BAD[_BAD.index(f.severity) :]:
            if _value(series, "gpuwatch_gpu_health_state", {**labels, "state": state}) == 1:
                return f"{shown} 1 and {_show('gpuwatch_gpu_health_state', {**labels, 'state': state})} 1"
        return Pending(f"/metrics lacks {_show('gpuwatch_gpu_health_state', {**labels, 'state': f.severity})} 1")

    deadline = run.config.drills.detect_timeout_s
    plan = f'check /metrics for gpuwatch_gpu_finding{{gpu="{run.gpu}",drill="true"}} and the health state'
    return Step("alert_metric", plan, check, deadline)


def quarantined(run: Run) -> Step:
    def check() -> Outcome:
        why_not = _no_quarantine(run)
        run.quarantine_expected = why_not is None
        if why_not is not None:
            return Skip(why_not)
        g = gpu(run.api, run.gpu)
        if g.quarantined:
            return f"quarantined (epoch {g.epoch}): {g.quarantine_reason}"
        return Pending(
            f"GPU {run.gpu} is {g.state} and not quarantined (circuit breaker? see gpuwatch_breaker_tripped)"
        )

    def deadline() -> float:
        degraded = run.finding is not None and run.finding.severity == Severity.DEGRADED.value
        wait = run.config.policy.quarantine_degraded_after_s if degraded else 0.0
        return wait + run.config.drills.detect_timeout_s

    return Step(
        "quarantined", f"wait for GPU {run.gpu} to be quarantined when its finding calls for it", check, deadline
    )


def trainer_steps(run: Run) -> list[Step]:
    """Stop requested, checkpoint written, job resumed: each from the incident the remediation records."""
    drills, n = run.config.drills, run.gpu

    def look() -> Skip | wire.Incident | None:
        if not run.trainers:
            return Skip(f"no trainer on GPU {n}")
        if not run.quarantine_expected:
            return Skip("no quarantine, so no trainer is stopped")
        return _incident(run)

    def stop() -> Outcome:
        found = look()
        if isinstance(found, Skip):
            return found
        if found is None:
            return Pending(f"no incident for GPU {n} since the drill started")
        ranks = [r.model_dump() for r in found.ranks]
        return f"incident for job {found.job} (ranks {ranks}): {found.cause}"

    def checkpoint() -> Outcome:
        found = look()
        if isinstance(found, Skip):
            return found
        took = found.time_to_stop_s if found else None
        if found is None or took is None:
            return Pending("the ranks have not stopped yet")
        asked = found.stop_signal
        # Remediation records how each rank ended: "exited" on its own after the stop signal, or forced.
        forced = [r for r in found.ranks if r.ended in ("SIGTERM", "SIGKILL")]
        if forced:
            how = ", ".join(f"rank {r.rank} by {r.ended}" for r in forced)
            raise DrillError(f"not every rank left on {asked} with a checkpoint: stopped {how}")
        return f"the ranks checkpointed and exited on {asked or 'the stop request'}, {took:.1f} s after the quarantine"

    def resumed() -> Outcome:
        found = look()
        if isinstance(found, Skip):
            return found
        if found is not None and found.status == "not_resumed":
            raise DrillError(f"the job did not resume (incident status not_resumed, job {found.job})")
        took = found.time_to_resume_s if found else None
        if found is None or took is None:
            return Pending("the job has not resumed yet")
        return f"the job resumed {took:.1f} s after the quarantine, {found.steps_lost} step(s) lost"

    grace = run.config.trainer.grace_period_s + drills.detect_timeout_s
    return [
        Step("trainer_stop_requested", f"GET /v1/incidents: a stop request for GPU {n}", stop, drills.detect_timeout_s),
        Step("checkpoint_written", "the ranks checkpoint and exit within the grace period", checkpoint, grace),
        Step("job_resumed", "the job runs again without the GPU", resumed, drills.resume_timeout_s),
    ]


def released(run: Run) -> Step:
    """The daemon's own burn-in releases an automatic quarantine; awaited only when asked (it takes long)."""
    policy, drills = run.config.policy, run.config.drills

    def check() -> Outcome:
        if not run.await_release:
            return Skip("not awaited: pass --await-release or set drills.await_release")
        if not run.quarantine_expected:
            return Skip("the GPU was not quarantined")
        g = gpu(run.api, run.gpu)
        if not g.quarantined:
            return f"released; GPU {run.gpu} is {g.state}"
        return Pending(f"GPU {run.gpu} is still quarantined ({g.state})")

    deadline = _lasts(run) + policy.recovery_s + policy.burn_in_s + drills.burn_in_timeout_s
    return Step("released_after_burn_in", "wait for the daemon's burn-in to release the GPU", check, deadline)


def _lasts(run: Run) -> float:
    """How long the fault lasts: an injection of readings lasts `for`; an event or a real fault is one-off."""
    return run.spec.duration_s if isinstance(run.spec, InjectSpec) and run.spec.fields else 0.0


def _found(run: Run) -> wire.Finding:
    assert run.finding is not None, "the finding step runs first"
    return run.finding


def _no_quarantine(run: Run) -> str | None:
    """Why no quarantine follows this finding, or None when one must."""
    f, policy = _found(run), run.config.policy
    if f.severity not in _BAD:
        return f"{f.rule} is a {f.severity} finding: nothing is quarantined for it"
    if f.severity == Severity.UNHEALTHY.value:
        return None if policy.quarantine_on_unhealthy else "policy.quarantine_on_unhealthy is off"
    lasts = _lasts(run)
    if lasts >= run.expect.lag_s + policy.quarantine_degraded_after_s:
        return None
    return (
        f"a degraded GPU is quarantined after policy.quarantine_degraded_after_s = "
        f"{policy.quarantine_degraded_after_s:g} s; this fault lasts {lasts:g} s"
    )


def _incident(run: Run) -> wire.Incident | None:
    for incident in incidents(run.api):
        same_gpu = incident.gpu == run.gpu or (run.uuid and incident.uuid == run.uuid)
        if same_gpu and incident.t >= run.started - 1.0:
            return incident
    return None


Series = dict[str, list[tuple[dict[str, str], float]]]


def _series(text: str) -> Series:
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return series


def _value(series: Series, name: str, want: dict[str, str]) -> float | None:
    for labels, value in series.get(name, []):
        if all(labels.get(k) == v for k, v in want.items()):
            return value
    return None


def _show(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
