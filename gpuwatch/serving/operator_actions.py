"""What an operator's quarantine or release did, in words, and when a release must be forced.

Pure functions of the GPU's status before and after, so the API can answer with what changed
instead of the bare GPU (a second quarantine, or a release of a GPU that was not quarantined,
used to look exactly like one that did something).
"""

from __future__ import annotations

from gpuwatch.model import GpuStatus, Health

BAD = (Health.DEGRADED, Health.UNHEALTHY)


def quarantine_outcome(before: GpuStatus, after: GpuStatus, reason: str) -> tuple[bool, str]:
    """(changed, message) of an operator's quarantine with `reason`."""
    n = after.index
    if not before.quarantined and after.quarantined:
        return True, f"GPU {n} quarantined (epoch {after.epoch}): {after.quarantine_reason}"
    if after.quarantine_reason != before.quarantine_reason:
        return True, (
            f"GPU {n} was quarantined automatically ({before.quarantine_reason}); "
            f"now held by the operator: {after.quarantine_reason}"
        )
    kept = "" if reason == after.quarantine_reason else f"; the reason stays {after.quarantine_reason!r}"
    return False, f"GPU {n} was already quarantined by an operator: nothing changed{kept} (release it first)"


def release_refusal(status: GpuStatus) -> str | None:
    """Why releasing this quarantined GPU needs force (it is still degraded or unhealthy), or None."""
    if not status.quarantined:
        return None
    bad = [f for f in status.findings if f.severity.health in BAD]
    if not bad and status.state not in BAD:
        return None
    why = "; ".join(f"{f.rule} ({f.severity.value}): {f.reason}" for f in bad) or (
        "no finding is active, but it has not been clean for the recovery time yet"
    )
    n = status.index
    return f"GPU {n} is still {status.state.value}: {why}. Release it anyway with force (gpuwatch release {n} --force)"


def release_outcome(before: GpuStatus, after: GpuStatus) -> tuple[bool, str]:
    """(changed, message) of an operator's release."""
    n = after.index
    if not before.quarantined:
        return False, f"GPU {n} was not quarantined: nothing changed"
    if after.quarantined:
        return False, f"GPU {n} is still quarantined: {after.quarantine_reason}"
    return True, f"GPU {n} released; state {after.state.value}"
