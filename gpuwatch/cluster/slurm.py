"""Drain this node in Slurm while gpuwatch holds its GPUs out of service, and resume it afterwards.

Slurm's HealthCheckProgram does not drain a node on an exit code: the program must drain it itself,
as LBNL NHC does. gpuwatch does it from the daemon (a worker thread, so a slow or hung slurmctld
never blocks sampling or serving) and from `gpuwatch check --slurm`.

* `wanted` (pure): what the GPUs call for under `slurm.drain_on`: drain (with a reason), resume
  (no GPU quarantined any more) or hold (leave the node as it is).
* `plan` (pure): what to do given the node's state as Slurm reports it. A drain whose reason starts
  with `gpuwatch:` is gpuwatch's; any other drain is an operator's and is never resumed or
  overwritten. The reason is read back with `scontrol show node` every time, so a node gpuwatch
  drained before a daemon restart is still recognised after it.
* `Scontrol` runs the program with a timeout; `Drainer` retries failures with back-off.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.base.tools import run_tool
from gpuwatch.config import SlurmConfig
from gpuwatch.errors import GpuwatchError
from gpuwatch.model import GpuStatus, Snapshot

log = logging.getLogger("gpuwatch.slurm")

REASON_PREFIX = "gpuwatch:"
MAX_REASON = 200  # Slurm keeps the reason; a page-long one helps nobody in `sinfo -R`
DrainGate = Callable[[], "str | None"]  # the fleet breaker: None allows a drain, else why not


class SlurmError(GpuwatchError):
    """scontrol is missing, failed, hung, or printed what we cannot read."""


@dataclass(frozen=True)
class GpuView:
    """What the drain policy needs of one GPU, from a Snapshot or from the daemon's API."""

    index: int
    uuid: str
    state: str
    quarantined: bool
    cause: str  # the worst finding's rule, else the quarantine's reason

    @classmethod
    def from_status(cls, status: GpuStatus) -> GpuView:
        ranked = sorted(status.findings, key=lambda f: f.severity.health.rank, reverse=True)
        cause = ranked[0].rule if ranked else f"quarantined: {status.quarantine_reason}"
        return cls(status.index, status.uuid, status.state.value, status.quarantined, cause)

    @classmethod
    def from_api(cls, gpu: Mapping[str, Any]) -> GpuView:
        """One entry of GET /v1/gpus."""
        order = {"unhealthy": 0, "degraded": 1}
        findings = sorted(gpu.get("findings") or [], key=lambda f: order.get(str(f.get("severity")), 2))
        cause = str(findings[0]["rule"]) if findings else f"quarantined: {gpu.get('quarantine_reason') or ''}"
        return cls(int(gpu["index"]), str(gpu["uuid"]), str(gpu["state"]), bool(gpu["quarantined"]), cause)


@dataclass(frozen=True)
class Want:
    """What the GPUs call for: `drain` (with `reason`), `resume`, or `hold` (leave the node as it is)."""

    action: str
    reason: str = ""


def node_faults(findings: Sequence[Mapping[str, Any]]) -> list[str]:
    """`rule: reason` of each unhealthy finding on the node itself (a GPU missing), from their JSON form."""
    return [f"{f['rule']}: {f.get('reason', '')}" for f in findings if f.get("severity") == "unhealthy"]


def wanted(gpus: Sequence[GpuView], policy: SlurmConfig, node: Sequence[str] = ()) -> Want:
    """The drain the policy calls for; resume once no GPU is quarantined any more.

    A fault of the node itself (`node`: a GPU the node should have is missing) drains it under `unhealthy`
    and `any_quarantine`; under `usable_below` the missing GPUs already count as not usable.
    """
    if node and policy.drain_on != "usable_below":
        return Want("drain", _one_line(f"{REASON_PREFIX} {node[0]}"))
    quarantined = [g for g in gpus if g.quarantined]
    unusable = [g for g in gpus if g.quarantined or g.state == "unhealthy"]
    if policy.drain_on == "unhealthy":
        culprits = [g for g in quarantined if g.state == "unhealthy"]
    elif policy.drain_on == "any_quarantine":
        culprits = quarantined
    else:
        culprits = unusable if len(gpus) - len(unusable) < policy.min_usable_gpus else []
    if culprits:
        return Want("drain", drain_reason(culprits, len(gpus) - len(unusable), policy))
    if policy.drain_on == "usable_below" and len(gpus) < policy.min_usable_gpus:
        return Want("drain", f"{REASON_PREFIX} {len(gpus)} GPU(s) usable, fewer than {policy.min_usable_gpus}")
    return Want("hold") if quarantined else Want("resume")


def drain_reason(culprits: Sequence[GpuView], usable: int, policy: SlurmConfig) -> str:
    """`gpuwatch: GPU 3 GPU-… ecc_uncorrectable`, one line, printable, at most MAX_REASON characters."""
    first = culprits[0]
    text = f"{REASON_PREFIX} GPU {first.index} {first.uuid} {first.cause}"
    if len(culprits) > 1:
        text += f" (+{len(culprits) - 1} more GPU(s))"
    if policy.drain_on == "usable_below":
        text += f"; {usable} usable, fewer than {policy.min_usable_gpus}"
    return _one_line(text)


def _one_line(text: str) -> str:
    """What Slurm keeps as a reason: printable ASCII, at most MAX_REASON characters."""
    return re.sub(r"[^\x20-\x7e]", "?", text)[:MAX_REASON]


@dataclass(frozen=True)
class SlurmNode:
    """The node as `scontrol show node` reports it."""

    name: str
    state: str  # e.g. IDLE, IDLE+DRAIN, DRAINED, MIXED+DRAIN
    reason: str  # without Slurm's trailing "[user@time]"

    @property
    def drained(self) -> bool:
        return any(part.startswith("DRAIN") for part in self.state.upper().split("+"))

    @property
    def ours(self) -> bool:
        return self.drained and self.reason.startswith(REASON_PREFIX)


def parse_show_node(name: str, text: str) -> SlurmNode:
    """State and Reason of `scontrol show node NAME` (the multi-line form: Reason has a line of its own).

    Raises:
        SlurmError: no State= in the output.
    """
    state = re.search(r"(?:^|\s)State=(\S+)", text)
    if state is None:
        raise SlurmError(f"scontrol show node {name}: no State= in its output: {text.strip()[:200]!r}")
    reason = re.search(r"^\s*Reason=(.*?)(?:\s+\[[^\]]*\])?\s*$", text, re.MULTILINE)
    return SlurmNode(name, state.group(1), reason.group(1) if reason and reason.group(1) != "(null)" else "")


def plan(want: Want, node: SlurmNode) -> str | None:
    """`drain`, `resume` or None. Never touches a drain that is not gpuwatch's."""
    if want.action == "drain" and not node.drained:
        return "drain"
    if want.action == "resume" and node.ours:
        return "resume"
    return None


class Scontrol:
    """Runs scontrol with a timeout; every failure is one SlurmError line."""

    def __init__(self, program: str, timeout_s: float) -> None:
        self.program = program
        self.timeout_s = timeout_s

    def show(self, name: str) -> SlurmNode:
        return parse_show_node(name, self._run("show", "node", name))

    def drain(self, name: str, reason: str) -> None:
        self._run("update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}")

    def resume(self, name: str) -> None:
        self._run("update", f"NodeName={name}", "State=RESUME")

    def _run(self, *args: str) -> str:
        argv = [self.program, *args]
        return run_tool(
            argv,
            self.timeout_s,
            error=SlurmError,
            setting="slurm.scontrol",
            timeout_setting="slurm.timeout_s",
            what=" ".join(argv[:3]),  # not the drain reason
            check=True,
        ).stdout


def node_name(config: SlurmConfig) -> str:
    """slurm.node_name, else this host's short name (how Slurm names nodes by default)."""
    return config.node_name or socket.gethostname().split(".")[0]


def reconcile(scontrol: Scontrol, name: str, want: Want, gate: DrainGate | None = None) -> tuple[SlurmNode, str]:
    """Read the node, act once if the plan says so; returns the node as read and what was done.

    What was done: `drained`, `resumed`, `refused: <why>` (the fleet breaker), or `unchanged`.

    Raises:
        SlurmError: scontrol failed.
    """
    node = scontrol.show(name)
    step = plan(want, node)
    if step == "drain":
        refusal = gate() if gate is not None else None
        if refusal is not None:
            return node, f"refused: {refusal}"
        scontrol.drain(name, want.reason)
        log.warning("slurm: drained node %s: %s", name, want.reason)
        return dataclasses.replace(node, state=node.state + "+DRAIN", reason=want.reason), "drained"
    if step == "resume":
        scontrol.resume(name)
        log.warning("slurm: resumed node %s (no GPU quarantined any more; was: %s)", name, node.reason)
        return dataclasses.replace(node, state=node.state.split("+")[0], reason=""), "resumed"
    return node, "unchanged"


@dataclass(frozen=True)
class DrainStatus:
    """What the Slurm collector exports; hashable, so it is also part of the /metrics render key."""

    wanted: bool = False  # the policy calls for a drain
    drained: bool = False  # the node is drained with a gpuwatch reason (as last read)
    drained_by_other: bool = False  # drained with a reason gpuwatch did not set
    refused: bool = False  # the fleet breaker refuses the drain
    failing: bool = False  # the last scontrol call failed; retrying with back-off
    failures_total: int = 0
    drains_total: int = 0
    resumes_total: int = 0


class SlurmCollector(Collector):
    """gpuwatch_slurm_* from the drainer's status."""

    def __init__(self, status: Callable[[], DrainStatus]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        s = self._status()
        for name, doc, value in (
            ("drain_wanted", "1 while the drain policy (slurm.drain_on) calls for draining this node.", s.wanted),
            ("drained", "1 while the node is drained in Slurm with a reason gpuwatch set.", s.drained),
            ("drained_by_other", "1 while the node is drained with a reason gpuwatch did not set.", s.drained_by_other),
            ("drain_refused", "1 while the fleet breaker refuses to drain this node.", s.refused),
            ("scontrol_failing", "1 while the last scontrol call failed (retried with back-off).", s.failing),
        ):
            yield GaugeMetricFamily(f"gpuwatch_slurm_{name}", doc, value=int(value))
        yield CounterMetricFamily("gpuwatch_slurm_scontrol_failures", "scontrol calls that failed.", s.failures_total)
        yield CounterMetricFamily("gpuwatch_slurm_drains", "Drains of this node gpuwatch made.", s.drains_total)
        yield CounterMetricFamily("gpuwatch_slurm_resumes", "Resumes of this node gpuwatch made.", s.resumes_total)


class Drainer:
    """Keeps the node's Slurm state in line with its GPUs, from a thread of its own.

    `on_publish` (a Monitor listener, on the sampling thread) only records what the GPUs call for;
    the worker reads the node, acts, and on failure retries after 1, 2, 4, … s (at most
    `retry_max_s`). It re-reads the node every `reconcile_s` even when nothing changed.
    """

    def __init__(
        self,
        config: SlurmConfig,
        scontrol: Scontrol | None = None,
        gate: DrainGate | None = None,
    ) -> None:
        self.config = config
        self.name = node_name(config)
        self.scontrol = scontrol or Scontrol(config.scontrol, config.timeout_s)
        self.gate = gate
        self._want = Want("hold")
        self._told: Want | None = None  # the drain wanted when an operator's drain was last reported
        self._applied = ""  # the reason of gpuwatch's last drain; an operator's resume of it is respected
        self._status = DrainStatus()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-slurm", daemon=True)

    def on_publish(self, snapshot: Snapshot, decisions: object) -> None:
        node = node_faults([f.as_dict() for f in snapshot.node_findings])
        want = wanted([GpuView.from_status(g) for g in snapshot.gpus], self.config, node)
        with self._lock:
            if want != self._want:
                self._want = want
                self._status = dataclasses.replace(self._status, wanted=want.action == "drain")
                self._wake.set()

    def status(self) -> DrainStatus:
        return self._status

    def start(self) -> None:
        log.info("slurm: draining node %s when %s (scontrol %s)", self.name, self.config.drain_on, self.config.scontrol)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.timeout_s + 5)

    def step(self) -> None:
        """One reconcile pass; raises SlurmError (counted) when scontrol fails."""
        with self._lock:
            want = self._want
        if want.action == "drain" and want.reason == self._applied:
            want = Want("hold")  # drained once for this; if the node is in service now, an operator resumed it
        try:
            node, done = reconcile(self.scontrol, self.name, want, self.gate)
        except SlurmError:
            self._update(failing=True, add={"failures_total": 1})
            raise
        if done == "drained":
            self._applied = want.reason
        elif want.action == "resume":
            self._applied = ""
        if done.startswith("refused") and not self._status.refused:
            log.warning(
                "slurm: the fleet breaker refuses to drain node %s: %s", self.name, done.removeprefix("refused: ")
            )
        if want.action == "drain" and node.drained and not node.ours and self._told != want:
            self._told = want
            log.warning(
                "slurm: node %s is drained by someone else (%s); gpuwatch leaves that drain alone",
                self.name,
                node.reason,
            )
        self._update(
            drained=node.ours,
            drained_by_other=node.drained and not node.ours,
            refused=done.startswith("refused"),
            failing=False,
            add={"drains_total": done == "drained", "resumes_total": done == "resumed"},
        )

    def _update(self, add: Mapping[str, int] | None = None, **changes: bool) -> None:
        """Set flags and add to counters under the lock `on_publish` takes too."""
        with self._lock:
            counts = {name: getattr(self._status, name) + int(n) for name, n in (add or {}).items()}
            self._status = dataclasses.replace(self._status, **changes, **counts)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.step()
                failures = 0
            except SlurmError as exc:
                failures += 1
                backoff = min(self.config.retry_max_s, 2.0 ** (failures - 1))
                log.error("slurm: %s; retry %d in %.0f s", exc, failures, backoff)
                self._stop.wait(backoff)  # back off even when the GPUs change meanwhile
                continue
            except Exception:  # a bug here must not end the thread that keeps Slurm in line
                log.exception("slurm: reconcile failed")
                self._stop.wait(self.config.retry_max_s)
                continue
            # A refused drain asks the fleet breaker again soon; otherwise wait for a change.
            self._wake.wait(min(self.config.reconcile_s, 15.0) if self._status.refused else self.config.reconcile_s)
