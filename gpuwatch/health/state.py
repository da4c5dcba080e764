"""Per-GPU health state with hysteresis, quarantine decisions, and the node's circuit breaker.

Pure and immutable: `step` takes the node's state, this round's findings and the time, and returns
the next state and the decisions to act on (the monitor logs, persists and executes them).

* State is the worst finding's severity. Worse applies at once; better only after the better
  condition has held for `recovery_s`, never on one good sample.
* Auto quarantine: on unhealthy when `quarantine_on_unhealthy`, and on any degraded-or-worse
  state that has lasted `quarantine_degraded_after_s`. It is released by burn-in: no
  degraded-or-worse finding for `burn_in_s`. Operator quarantines are released only by an operator,
  and an operator's release holds off auto quarantine until the GPU's bad episode ends or worsens.
* Circuit breaker: at most max(1, ⌊breaker_max_share × GPUs⌋) auto quarantines within
  `breaker_window_s`, so a bad rule, driver or rack cannot take a whole node out. Operator
  quarantines bypass it. It counts drill quarantines too: a drill takes real GPUs out.
* Gate: an optional callable asked after the node breaker allows an auto quarantine (the fleet
  breaker, gpuwatch/cluster/fleet.py, which asks Prometheus); it returns None to allow or why it refuses.
  This module only calls it: whatever it reads is the caller's business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwatch.config import PolicyConfig
from gpuwatch.model import Finding, Health, worst

QuarantineGate = Callable[[int, str], "str | None"]  # (GPU index, reason) → None to allow, else the refusal


@dataclass(frozen=True)
class GpuState:
    """One GPU's place in the state machine."""

    index: int
    state: Health = Health.UNKNOWN
    since: float = 0.0  # last state change
    bad_since: float | None = None  # start of the current degraded-or-worse episode
    clean_since: float | None = None  # no degraded-or-worse finding since (recovery to healthy, burn-in)
    calm_since: float | None = None  # no unhealthy finding since (recovery from unhealthy to degraded)
    quarantined: bool = False
    quarantine_reason: str = ""
    quarantined_since: float | None = None
    quarantine_auto: bool = False  # released by burn-in (True) or only by an operator (False)
    epoch: int = 0  # grows with every quarantine: trainers compare it to notice one
    drill: bool = False  # the latest bad episode or quarantine came from drills only
    acknowledged: bool = False  # an operator released it during this bad episode: no auto quarantine
    refused: bool = False  # the breaker refused this episode's quarantine (reported once)


@dataclass(frozen=True)
class Decision:
    """Something the monitor must log and act on. `kind`: state | quarantine | release | refused | validate.

    `validate`: the GPU has burned in, but its release waits for an active test (the monitor runs it
    and releases the GPU only if it passes); repeated every round until then.
    """

    kind: str
    index: int
    t: float
    reason: str
    state: Health
    drill: bool = False
    auto: bool = True


@dataclass(frozen=True)
class NodeState:
    """Every GPU's state plus the circuit breaker's memory of recent auto quarantines."""

    gpus: tuple[GpuState, ...]
    auto_quarantines: tuple[float, ...] = ()
    breaker_refusals: int = 0
    breaker_tripped: bool = False  # the window holds as many auto quarantines as allowed


def initial(indices: Iterable[int]) -> NodeState:
    """Every GPU unknown until its first judgement."""
    return NodeState(gpus=tuple(GpuState(index=i) for i in indices))


def step(
    node: NodeState,
    findings: Mapping[int, Sequence[Finding]],
    now: float,
    policy: PolicyConfig,
    gate: QuarantineGate | None = None,
    validate: Collection[int] = (),
) -> tuple[NodeState, list[Decision]]:
    """Advance every GPU judged this round.

    `findings` maps each judged GPU to its findings (empty: nothing wrong). A GPU missing from it
    was not judged (no samples yet) and keeps its state. A GPU in `validate` is not released by
    burn-in itself: it gets a `validate` decision instead (drill quarantines excepted).
    """
    decisions: list[Decision] = []
    for position in range(len(node.gpus)):  # _put keeps each GPU at its position
        before = node.gpus[position]
        found = findings.get(before.index)
        if found is None:
            continue
        gpu, changed = _judge(before, found, now, policy)
        if gpu is not before:  # the usual round changes nothing: no copy of the node
            node = _put(node, gpu)
        decisions += changed
        node, acted = _act(node, gpu, found, now, policy, gate, gpu.index in validate)
        decisions += acted
    if not node.auto_quarantines and not node.breaker_tripped:  # the usual tick: the breaker has nothing to forget
        return node, decisions
    recent = _recent(node, now, policy)
    tripped = len(recent) >= breaker_limit(len(node.gpus), policy)
    if recent == node.auto_quarantines and tripped == node.breaker_tripped:
        return node, decisions
    return dataclasses.replace(node, auto_quarantines=recent, breaker_tripped=tripped), decisions


def quarantine(
    node: NodeState,
    index: int,
    reason: str,
    now: float,
    *,
    auto: bool = False,
    drill: bool = False,
    policy: PolicyConfig | None = None,
) -> tuple[NodeState, list[Decision]]:
    """Quarantine GPU `index`; bumps its epoch.

    An operator's quarantine (auto=False) bypasses the breaker, is released only by an operator, and
    takes over an automatic one already in place. An automatic one needs `policy` for the breaker.

    Raises:
        KeyError: no GPU `index`.
        ValueError: auto=True without a policy.
    """
    gpu = _get(node, index)
    if auto:
        if policy is None:
            raise ValueError("an automatic quarantine needs the policy of its circuit breaker")
        return _auto_quarantine(node, gpu, reason, now, drill, policy)
    if gpu.quarantined:
        if not gpu.quarantine_auto:
            return node, []
        held = dataclasses.replace(gpu, quarantine_auto=False, quarantine_reason=reason)
        decision = Decision("quarantine", index, now, f"now held by the operator: {reason}", gpu.state, drill, False)
        return _put(node, held), [decision]
    return _quarantine(node, gpu, reason, now, auto=False, drill=drill)


def release(
    node: NodeState, index: int, now: float, reason: str = "operator", *, auto: bool = False
) -> tuple[NodeState, list[Decision]]:
    """An operator releases GPU `index` (nothing happens if it is not quarantined); `auto`: the monitor
    releases it after a passed validation, as burn-in would have.

    Raises:
        KeyError: no GPU `index`.
    """
    return _release(node, _get(node, index), now, reason, auto=auto)


def breaker_limit(n_gpus: int, policy: PolicyConfig) -> int:
    """How many auto quarantines the breaker allows within its window."""
    return max(1, math.floor(policy.breaker_max_share * n_gpus + 1e-9))


def _judge(
    gpu: GpuState, found: Sequence[Finding], now: float, policy: PolicyConfig
) -> tuple[GpuState, list[Decision]]:
    """The GPU's next state from this round's findings, and a "state" decision if it changed."""
    bad = [f for f in found if _is_bad(f.severity.health)]
    target = worst([f.severity.health for f in found])
    clean_since = None if bad else (now if gpu.clean_since is None else gpu.clean_since)
    calm_since = None if target is Health.UNHEALTHY else (now if gpu.calm_since is None else gpu.calm_since)
    drill = gpu.drill
    if bad:
        # An episode is a drill while every bad finding in it is one; a real one in between makes it real.
        drill = all(f.drill for f in bad) and (gpu.drill or not _is_bad(gpu.state))
    if (clean_since, calm_since, drill) != (gpu.clean_since, gpu.calm_since, gpu.drill):
        gpu = dataclasses.replace(gpu, clean_since=clean_since, calm_since=calm_since, drill=drill)
    new = _next_state(gpu, target, now, policy.recovery_s)
    if new is gpu.state:
        return gpu, []
    worse = gpu.state is Health.UNKNOWN or new.rank > gpu.state.rank
    if new is Health.HEALTHY and worse:
        why = "first judgement, no degraded-or-worse finding"
    elif worse:
        why = "; ".join(f"{f.rule}: {f.reason}" for f in found if f.severity.health is new)
    else:
        why = f"no {'degraded-or-worse' if new is Health.HEALTHY else 'unhealthy'} finding for {policy.recovery_s:g} s"
    decision = Decision("state", gpu.index, now, f"{gpu.state.value} → {new.value}: {why}", new, drill)
    bad_since = (gpu.bad_since if _is_bad(gpu.state) else now) if _is_bad(new) else None
    gpu = dataclasses.replace(gpu, state=new, since=now, bad_since=bad_since)
    if worse or new is Health.HEALTHY:
        # A new or worse episode asks afresh: an operator's hold-off and a reported refusal end here.
        gpu = dataclasses.replace(gpu, acknowledged=False, refused=False)
    return gpu, [decision]


def _next_state(gpu: GpuState, target: Health, now: float, recovery_s: float) -> Health:
    current = gpu.state
    if current is Health.UNKNOWN or target.rank >= current.rank:
        return target
    if gpu.clean_since is not None and now - gpu.clean_since >= recovery_s:
        return Health.HEALTHY
    if current is Health.UNHEALTHY and gpu.calm_since is not None and now - gpu.calm_since >= recovery_s:
        return Health.DEGRADED
    return current


def _act(
    node: NodeState,
    gpu: GpuState,
    found: Sequence[Finding],
    now: float,
    policy: PolicyConfig,
    gate: QuarantineGate | None = None,
    validate: bool = False,
) -> tuple[NodeState, list[Decision]]:
    """Quarantine a GPU that has earned it, or release one that has burned in."""
    if not gpu.quarantined:
        why = _quarantine_reason(gpu, found, now, policy)
        if why is None or gpu.acknowledged:
            return node, []
        return _auto_quarantine(node, gpu, why, now, gpu.drill, policy, gate)
    burned_in = gpu.clean_since is not None and now - gpu.clean_since >= policy.burn_in_s
    if gpu.quarantine_auto and gpu.state is Health.HEALTHY and burned_in:
        why = f"burn-in: no degraded-or-worse finding for {policy.burn_in_s:g} s"
        if validate and not gpu.drill:
            return node, [Decision("validate", gpu.index, now, why, gpu.state, gpu.drill)]
        return _release(node, gpu, now, why, auto=True)
    return node, []


def _quarantine_reason(gpu: GpuState, found: Sequence[Finding], now: float, policy: PolicyConfig) -> str | None:
    if not _is_bad(gpu.state):  # the usual tick: nothing to word
        return None
    bad = "; ".join(f"{f.rule}: {f.reason}" for f in found if _is_bad(f.severity.health)) or "recovering"
    if gpu.state is Health.UNHEALTHY and policy.quarantine_on_unhealthy:
        return f"unhealthy: {bad}"
    lasted = now - gpu.bad_since if gpu.bad_since is not None else 0.0
    if lasted >= policy.quarantine_degraded_after_s:
        return f"{gpu.state.value} for {lasted:.0f} s: {bad}"
    return None


def _auto_quarantine(
    node: NodeState,
    gpu: GpuState,
    reason: str,
    now: float,
    drill: bool,
    policy: PolicyConfig,
    gate: QuarantineGate | None = None,
) -> tuple[NodeState, list[Decision]]:
    if gpu.quarantined:
        return node, []
    recent = _recent(node, now, policy)
    limit = breaker_limit(len(node.gpus), policy)
    if len(recent) < limit:
        refusal = gate(gpu.index, reason) if gate is not None else None
        if refusal is not None:
            if gpu.refused:
                return node, []
            why = f"fleet breaker refused the quarantine: {refusal}; wanted for {reason}"
            refused = Decision("refused", gpu.index, now, why, gpu.state, drill)
            return _put(node, dataclasses.replace(gpu, refused=True)), [refused]
        node = dataclasses.replace(node, auto_quarantines=(*recent, now))
        return _quarantine(node, gpu, reason, now, auto=True, drill=drill)
    node = dataclasses.replace(node, auto_quarantines=recent, breaker_tripped=True)
    if gpu.refused:
        return node, []
    node = dataclasses.replace(node, breaker_refusals=node.breaker_refusals + 1)
    why = (
        f"circuit breaker refused the quarantine: {len(recent)} automatic quarantine(s) in the last "
        f"{policy.breaker_window_s:g} s reach its limit of {limit} ({policy.breaker_max_share:.0%} of "
        f"{len(node.gpus)} GPUs); wanted for {reason}"
    )
    refused = Decision("refused", gpu.index, now, why, gpu.state, drill)
    return _put(node, dataclasses.replace(gpu, refused=True)), [refused]


def _quarantine(
    node: NodeState, gpu: GpuState, reason: str, now: float, *, auto: bool, drill: bool
) -> tuple[NodeState, list[Decision]]:
    held = dataclasses.replace(
        gpu,
        quarantined=True,
        quarantine_reason=reason,
        quarantined_since=now,
        quarantine_auto=auto,
        epoch=gpu.epoch + 1,
        drill=drill,
        refused=False,
    )
    return _put(node, held), [Decision("quarantine", gpu.index, now, reason, gpu.state, drill, auto)]


def _release(
    node: NodeState, gpu: GpuState, now: float, reason: str, *, auto: bool
) -> tuple[NodeState, list[Decision]]:
    if not gpu.quarantined:
        return node, []
    freed = dataclasses.replace(
        gpu,
        quarantined=False,
        quarantine_reason="",
        quarantined_since=None,
        quarantine_auto=False,
        acknowledged=not auto and _is_bad(gpu.state),
    )
    return _put(node, freed), [Decision("release", gpu.index, now, reason, gpu.state, gpu.drill, auto)]


def _recent(node: NodeState, now: float, policy: PolicyConfig) -> tuple[float, ...]:
    return tuple(t for t in node.auto_quarantines if t > now - policy.breaker_window_s)


def _is_bad(health: Health) -> bool:
    return health.rank >= Health.DEGRADED.rank


def _get(node: NodeState, index: int) -> GpuState:
    for gpu in node.gpus:
        if gpu.index == index:
            return gpu
    raise KeyError(index)


def _put(node: NodeState, gpu: GpuState) -> NodeState:
    return dataclasses.replace(node, gpus=tuple(gpu if g.index == gpu.index else g for g in node.gpus))
