"""A drill from request to verdict: look at the target, refuse what the guards forbid, build the steps
of its kind, run them.

Guards run in a dry run too, so `--dry-run` says whether the real run would be refused. A refusal
is not a verdict: nothing happened, so nothing is stored (a scheduled one is counted as skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwatch.config import Config
from gpuwatch.drills import checks, destructive_steps, injectors, rank_faults, validate
from gpuwatch.drills.daemon_client import DrillApi, describe_trainers, gpu, inject, node, pids
from gpuwatch.drills.run_state import Run
from gpuwatch.drills.spec import KINDS, DcgmSpec, InjectSpec, expectation, parse_dcgm, parse_inject, xid_expectation
from gpuwatch.drills.steps import Clock, Outcome, Pending, Progress, Skip, Step, Verdict, deadline_of, execute
from gpuwatch.errors import DaemonError, DrillError

if TYPE_CHECKING:  # pydantic loads with the first answer read, not with the daemon that imports the drills
    from gpuwatch.serving import wire

XID_FAULT = 31
RANK_DRILLS: dict[str, Callable[[Run], list[Step]]] = {
    "kill_rank": rank_faults.kill_rank,
    "hang_rank": rank_faults.hang_rank,
    "fault_rank": rank_faults.fault_rank,
}
FAULT_WINDOW_S = 600.0  # how long findings on the GPU count as the drill's after a real fault


class DrillRefused(DrillError):
    """A guard said no. `reason` is a short label for gpuwatch_drill_skipped_total."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """What to drill: `gpu` is None when the spec names it (`--inject 'gpu=1,...'`)."""

    kind: str
    gpu: int | None
    spec: str = ""
    rank: int | None = None
    await_release: bool = False
    trigger: str = "cli"


def prepare(request: Request, api: DrillApi, config: Config, clock: Clock) -> Run:
    """Parse, look at the target GPU, and apply the guards.

    Raises:
        ConfigError: the spec is malformed.
        DrillRefused: a guard refuses the drill.
        DaemonError: the daemon cannot be reached.
    """
    kind = KINDS[request.kind]
    spec: InjectSpec | DcgmSpec | None = None
    if kind.name == "inject":
        spec = parse_inject(request.spec, need_gpu=request.gpu is None)
    elif kind.name == "dcgm_inject":
        spec = parse_dcgm(request.spec, need_gpu=request.gpu is None)
    index = request.gpu if request.gpu is not None else spec.gpu if spec is not None else None
    assert index is not None, "a request names its GPU or its spec does"
    before = _target(api, index)
    run = Run(
        kind,
        index,
        api,
        config,
        clock,
        before,
        spec,
        request.spec,
        request.rank,
        request.await_release,
        request.trigger,
    )
    if spec is not None:
        run.expect = expectation(spec, config)
    elif kind.name == "xid_fault":
        run.expect = xid_expectation(XID_FAULT)
    _guard(run)
    return run


def build(run: Run) -> list[Step]:
    """The ordered steps of the run's kind: the fault, then everything that must follow it."""
    name = run.kind.name
    if name == "inject":
        return [_inject(run), *checks.after_fault(run)]
    if name == "dcgm_inject":
        return [_dcgm(run), *checks.after_fault(run)]
    if name == "xid_fault":
        return [_xid_fault(run), *checks.after_fault(run), _kernel_log(run)]
    if name in RANK_DRILLS:
        return RANK_DRILLS[name](run)
    if name == "validate":
        return validate.steps(run)
    deed = destructive_steps.reset(run) if name == "reset_gpu" else destructive_steps.pcie(run)
    return [*destructive_steps.hands_off(run), *deed, *destructive_steps.come_back(run)]


def plan(run: Run) -> list[str]:
    """The dry run: one line per step, with its deadline."""
    lines = []
    for number, step in enumerate(build(run), 1):
        deadline = deadline_of(step)
        limit = f" (deadline {deadline:g} s)" if deadline is not None else ""
        lines.append(f"{number:2d}. {step.name:<24} {step.plan}{limit}")
    return lines


def run_drill(run: Run, progress: Progress | None = None) -> Verdict:
    run.started = run.clock.now()
    results = execute(build(run), run.clock, progress)
    return Verdict(run.kind.name, run.gpu, run.uuid, run.spec_text, run.trigger, run.started, run.clock.now(), results)


def _target(api: DrillApi, index: int) -> wire.Gpu:
    try:
        return gpu(api, index)
    except DaemonError as exc:
        if "HTTP 404" in str(exc):
            raise DrillRefused("no_such_gpu", f"the daemon has no GPU {index}") from None
        raise


def _guard(run: Run) -> None:
    """Refuse a target where the drill would prove nothing or hurt something."""
    g, n = run.before, run.gpu
    if g.quarantined:
        raise DrillRefused("target_quarantined", f"GPU {n} is quarantined ({g.quarantine_reason})")
    if g.state != "healthy":
        raise DrillRefused("target_unhealthy", f"GPU {n} is {g.state}: a drill on it would prove nothing")
    present = [f.rule for f in g.findings if f.rule in run.expect.rules]
    if present:
        raise DrillRefused("target_has_finding", f"GPU {n} already has {', '.join(present)}")
    kind_guard = _KIND_GUARDS.get(run.kind.name)
    if kind_guard is not None:
        kind_guard(run)


def _busy(run: Run) -> DrillRefused:
    """GPU N has processes on it, and where to find a GPU without (the sim gives each GPU one but in `idle`)."""
    hint = "pick a GPU without any"
    if node(run.api).backend == "sim":
        hint += " (the sim puts a process on every GPU: run its daemon with --sim-scenario idle)"
    return DrillRefused("target_busy", f"GPU {run.gpu} has processes on it ({pids(run.before)}): {hint}")


def _no_process(run: Run) -> None:
    """xid_fault: the sacrificial process must be the only one on the GPU."""
    if pids(run.before):
        raise _busy(run)
    script = injectors.xid_script(run.config)
    if not script.exists():
        raise DrillRefused("not_supported", f"{script} not found (set tools.xid_fault)")


def _only_trainers(run: Run) -> None:
    """reset_gpu, pcie_remove: trainers will be stopped; any other process makes the GPU off limits."""
    trainer_pids = {t.pid for t in run.trainers}
    listed = injectors.compute_pids(run.config.tools.nvidia_smi, run.uuid)
    others = sorted({*pids(run.before), *listed} - trainer_pids)
    if others:
        raise DrillRefused("target_busy", f"GPU {run.gpu} has processes that are not trainers on it ({others})")
    if run.kind.name == "pcie_remove":
        try:
            injectors.pci_paths(run.config.tools.sysfs_root, run.before.pci_bus_id)
        except DrillError as exc:
            raise DrillRefused("not_supported", str(exc)) from None


def _pick_victim(run: Run) -> None:
    run.victim = _victim(run)


def _opted_in_victim(run: Run) -> None:
    """fault_rank: only a rank that said it accepts drills (TrainerLink(allow_drills=True)) is faulted."""
    victim = _victim(run)
    if victim.allow_drills is not True:
        who = f"rank {victim.rank} (pid {victim.pid})"
        raise DrillRefused("not_opted_in", f"{who} did not opt in to drills: TrainerLink(allow_drills=True)")
    run.victim = victim


def _dcgm_backend(run: Run) -> None:
    backend = node(run.api).backend
    if backend != "dcgm":
        raise DrillRefused("not_supported", f"the daemon reads {backend}, so it never sees DCGM's cache")


def _idle(run: Run) -> None:
    """validate: the GPU test never runs beside anything else."""
    if pids(run.before):
        raise _busy(run)


_KIND_GUARDS: dict[str, Callable[[Run], None]] = {
    "validate": _idle,
    "xid_fault": _no_process,
    "reset_gpu": _only_trainers,
    "pcie_remove": _only_trainers,
    "kill_rank": _pick_victim,
    "hang_rank": _pick_victim,
    "fault_rank": _opted_in_victim,
    "dcgm_inject": _dcgm_backend,
}


def _victim(run: Run) -> wire.Trainer:
    ranks = sorted(run.trainers, key=lambda t: (t.rank is None, t.rank or 0))
    if run.rank is not None:
        ranks = [t for t in ranks if t.rank == run.rank]
    if not ranks:
        on = describe_trainers(run.before)
        wanted = f"rank {run.rank}" if run.rank is not None else "trainer"
        raise DrillRefused("no_trainer", f"no {wanted} on GPU {run.gpu} (trainers: {on})")
    return ranks[0]


def _mark(run: Run) -> None:
    """Tell the daemon that findings on the GPU are the drill's for a while (drill="true" on metrics)."""
    run.api.post("/v1/drills/window", {"gpu": run.gpu, "duration_s": FAULT_WINDOW_S})


def _inject(run: Run) -> Step:
    spec = run.spec
    assert spec is not None and not isinstance(spec, DcgmSpec)

    def check() -> Outcome:
        injection = inject(run.api, run.gpu, spec.body())
        return f"injection {injection.id} on GPU {run.gpu} for {spec.duration_s:g} s: {spec.body()}"

    return Step("inject", f"POST /v1/gpus/{run.gpu}/inject {spec.body()}", check)


def _dcgm(run: Run) -> Step:
    spec = run.spec
    assert isinstance(spec, DcgmSpec)
    dcgmi = run.config.tools.dcgmi

    def check() -> Outcome:
        _mark(run)
        return injectors.dcgm_inject(dcgmi, run.gpu, spec.field_id, spec.value)

    plan = f"{dcgmi} test --inject --gpuid {run.gpu} -f {spec.field_id} -v {spec.value:g}"
    return Step("inject", plan, check)


def _xid_fault(run: Run) -> Step:
    script = injectors.xid_script(run.config)

    def check() -> Outcome:
        _mark(run)
        report = injectors.run_xid_fault(script, run.gpu)
        run.fault_report = report
        took = report["exited_t"] - report["started_t"]
        return f"child pid {report['pid']} died of the fault (exit {report['returncode']}) after {took:.1f} s"

    return Step("fault", f"run {script} --gpu {run.gpu} --yes (a real XID 31)", check)


def _kernel_log(run: Run) -> Step:
    kmsg = run.config.tools.kmsg

    def check() -> Outcome:
        pid = run.fault_report.get("pid")
        try:
            line = injectors.kernel_xid_line(kmsg, int(pid or 0))
        except OSError as exc:
            return Skip(f"{kmsg} cannot be read: {exc.strerror or exc}")
        return line or Pending(f"no 'NVRM: Xid ... pid={pid},' line in {kmsg}")

    deadline = run.config.drills.event_detect_timeout_s
    return Step("kernel_log", f"find the driver's NVRM: Xid line for the child in {kmsg}", check, deadline)
