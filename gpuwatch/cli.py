"""The `gpuwatch` command line: parses flags into a Config and calls the daemon, the client or offline judging.

Every gpuwatch error ends as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from gpuwatch import __version__
from gpuwatch.base.command_error import FiniteFloatRange, OneLineGroup, fail
from gpuwatch.config import Config, load
from gpuwatch.errors import GpuwatchError

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(func: F) -> F:
    """Turn any GpuwatchError into one line and exit 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except GpuwatchError as exc:
            fail(str(exc))

    return wrapper  # type: ignore[return-value]


def config_options(func: F) -> F:
    """Flags every command shares: where the config is and where the daemon lives."""
    for option in reversed(
        [
            click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file."),
            click.option("--listen", help="HOST:PORT of the API (default 127.0.0.1:9835)."),
            click.option(
                "--state-dir",
                help="The daemon's state dir, where its control socket lives (default /var/lib/gpuwatch).",
            ),
        ]
    ):
        func = option(func)
    return func


def backend_options(func: F) -> F:
    for option in reversed(
        [
            click.option("--backend", help="auto | nvml | dcgm | sim | replay (default auto)."),
            click.option("--sim-gpus", type=int, help="Simulated GPUs (sim backend, default 8)."),
            click.option("--sim-scenario", help="Sim scenario: demo (default), healthy, or a rule id."),
            click.option("--seed", type=int, help="Seed of the sim backend."),
            click.option("--replay-file", type=click.Path(dir_okay=False), help="Trace for the replay backend."),
        ]
    ):
        func = option(func)
    return func


def build_config(config_path: str | None, **flags: Any) -> Config:
    keys = {
        "sim_gpus": "sim.gpus",
        "sim_scenario": "sim.scenario",
        "seed": "sim.seed",
    }
    overrides = {keys.get(name, name): value for name, value in flags.items()}
    flag_names = {"interval_s": "--interval"} | {key: f"--{name.replace('_', '-')}" for name, key in keys.items()}
    return load(config_path, overrides=overrides, known_rules=_rule_names(), flag_names=flag_names)


def _rule_names() -> frozenset[str]:
    """The names `rules.disabled` may use: a rule id or module gpuwatch does not have is a typo, refused."""
    from gpuwatch.health.engine import known_names

    return known_names()


# Command groups `gpuwatch run` never runs, imported when first named: half a MiB of the daemon's RSS otherwise.
LAZY_COMMANDS = {
    "bench": ("gpuwatch.bench.cli", "bench"),
    "drill": ("gpuwatch.drills.cli", "drill"),
    "launch": ("gpuwatch.launcher.launch", "launch"),
    "service": ("gpuwatch.service.cli", "service"),
}


class _Commands(dict[str, click.Command]):
    """A group's commands by name, LAZY_COMMANDS among them, each imported at its first lookup."""

    def __missing__(self, name: str) -> click.Command:
        if name not in LAZY_COMMANDS:
            raise KeyError(name)
        module, attr = LAZY_COMMANDS[name]
        command: click.Command = getattr(importlib.import_module(module), attr)
        self[name] = command
        return command

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in LAZY_COMMANDS

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default


class _Main(OneLineGroup):
    """The top-level group, with LAZY_COMMANDS imported when named (or listed, for --help)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuwatch")
def main() -> None:
    """gpuwatch: GPU health daemon for PyTorch training fleets."""


@main.command()
@config_options
@backend_options
@click.option("--interval", "interval_s", type=float, help="Seconds between samples (1 to 3600, default 30).")
@click.option("--runtime-dir", help="Runtime dir shared with trainers (default /run/gpuwatch).")
@click.option("--log-level", help="debug | info | warning | error.")
@one_line_errors
def run(config_path: str | None, **flags: Any) -> None:
    """Run the daemon: sample, judge, export, serve."""
    from gpuwatch.daemon import Daemon, setup_logging
    from gpuwatch.node.statelock import NewDaemonDir

    config = build_config(config_path, **flags)
    setup_logging(config.log_level)
    new_dirs, daemon = [NewDaemonDir(config.state_dir), NewDaemonDir(config.runtime_dir)], None
    try:
        daemon = Daemon(config)
        daemon.serve()
    except BaseException:
        if daemon is None or not daemon.started:  # a start that failed leaves nothing behind
            for new_dir in new_dirs:
                new_dir.remove()
        raise


@main.command()
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON.")
@click.option("--wide", is_flag=True, help="Every column and value in full, however wide that is.")
@click.option("--plain", is_flag=True, help="One GPU per line, every value in full (the default when piped).")
@one_line_errors
def status(config_path: str | None, as_json: bool, wide: bool, plain: bool, **flags: Any) -> None:
    """Show the GPUs of the running daemon: a table that fits the terminal, or one GPU per line when piped."""
    from gpuwatch.serving import status_view
    from gpuwatch.serving.client import DaemonClient

    client = DaemonClient(build_config(config_path, **flags), config_path=config_path, over_tcp=True)
    listed = client.gpu_list()
    gpus = listed.gpus
    if client.answered_over_tcp:
        click.echo(f"gpuwatch: no control socket at {client.socket_path}: shown as {client.base} answered", err=True)
    if as_json:
        click.echo(json.dumps(listed.model_dump(mode="json"), indent=2))
        return
    from rich.console import Console  # here: `gpuwatch run` never loads rich

    console = Console()
    fitted = None if wide or plain or not console.is_terminal else status_view.fitted_table(gpus, console.width)
    if wide:
        table = status_view.wide_table(gpus)
        Console(width=max(Console(width=100_000).measure(table).maximum, console.width)).print(table)
    elif fitted is not None:
        console.print(fitted)
    else:
        for line in status_view.plain_lines(gpus):
            click.echo(line)
    lines = status_view.node_lines(listed.node_findings)
    for g in gpus:  # XIDs the kernel log holds (also from before the daemon started), with their kernel time
        for x in g.kernel_xids:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x.t))
            lines.append(f"GPU {g.index} kernel log {when} UTC: XID {x.xid}: {x.line}")
    for line in lines:  # on a terminal, one line each: the kernel's line in full is in --plain
        click.echo(line if fitted is None or len(line) <= console.width else line[: console.width - 1] + "…")


@main.command()
@config_options
@backend_options
@click.option("--samples", type=click.IntRange(1, 60), default=3, show_default=True, help="Samples to take.")
@click.option(
    "--duration",
    "duration_s",
    type=FiniteFloatRange(0, 3600),
    help="Seconds to sample, one sample a second. On the sim backend time is simulated and passes at once; "
    "the default there is the scenario's time to show its fault.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--slurm", is_flag=True, help="Ask the running daemon (else sample), then drain or resume this node in Slurm."
)
@one_line_errors
def check(
    config_path: str | None, samples: int, duration_s: float | None, as_json: bool, slurm: bool, **flags: Any
) -> None:
    """One-shot sample and judgement. Exit 0 healthy, 1 degraded or unhealthy, 2 error (Slurm HealthCheckProgram)."""
    config = build_config(config_path, **flags)
    listed = _daemon_view(config) if slurm else None
    from_daemon = listed is not None
    if listed is None:
        from gpuwatch.node.offline import check as run_check

        snapshot = run_check(config, samples=samples, duration_s=duration_s)
        rows: list[dict[str, Any]] = [
            {
                "index": g.index,
                "uuid": g.uuid,
                "state": g.state.value,
                "quarantined": g.quarantined,
                "quarantine_reason": g.quarantine_reason,
                "findings": [f.as_dict() for f in g.findings],
            }
            for g in snapshot.gpus
        ]
        listed = rows, [f.as_dict() for f in snapshot.node_findings]
    rows, node = listed
    bad = [g for g in rows if g["state"] in {"degraded", "unhealthy"}] + [f for f in node if f["severity"] in BAD]
    done = _slurm_check(config, rows, node, may_resume=from_daemon) if slurm else None
    if as_json:
        click.echo(json.dumps({"gpus": rows, "node_findings": node, **({"slurm": done} if done else {})}, indent=2))
    else:
        for g in rows:
            reasons = "; ".join(f"{f['rule']}: {f['reason']}" for f in g["findings"]) or "no findings"
            click.echo(f"GPU {g['index']} {g['uuid']} {g['state']}: {reasons}")
        for f in node:
            click.echo(f"node {f['severity']}: {f['rule']}: {f['reason']}")
        if done:
            click.echo(f"slurm: node {done['node']} {done['done']} (state {done['state']}, reason {done['reason']!r})")
    sys.exit(1 if bad else 0)


BAD = {"degraded", "unhealthy"}  # the severities (and states) that fail a check


def _daemon_view(config: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The running daemon's GPUs and node findings as GET /v1/gpus writes them (check's rows are its --json), or
    None when no daemon answers."""
    from gpuwatch.errors import DaemonError
    from gpuwatch.serving.client import DaemonClient

    try:
        listed = DaemonClient(config, timeout_s=5.0).gpu_list()
    except DaemonError as exc:
        click.echo(f"gpuwatch check: {exc}; sampling the GPUs itself", err=True)
        return None
    return [g.model_dump(mode="json") for g in listed.gpus], [f.model_dump(mode="json") for f in listed.node_findings]


def _slurm_check(
    config: Config, rows: list[dict[str, Any]], node: list[dict[str, Any]], may_resume: bool
) -> dict[str, str]:
    """Drain or resume the node as the daemon would; asks the fleet breaker first when one is configured.

    Only the daemon knows the quarantines it persisted: judged from a sample of its own, check drains but
    never resumes.
    """
    from gpuwatch.cluster import slurm
    from gpuwatch.cluster.fleet import FleetBreaker

    gate = FleetBreaker(config.fleet).allow_drain if config.fleet.prometheus_url else None  # asks, within timeout_s
    scontrol = slurm.Scontrol(config.slurm.scontrol, config.slurm.timeout_s)
    name = slurm.node_name(config.slurm)
    want = slurm.wanted([slurm.GpuView.from_api(g) for g in rows], config.slurm, slurm.node_faults(node))
    if want.action == "resume" and not may_resume:
        want = slurm.Want("hold")
    node_now, done = slurm.reconcile(scontrol, name, want, gate)
    return {"node": name, "done": done, "state": node_now.state, "reason": node_now.reason}


@main.command()
@config_options
@backend_options
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
@click.option("--duration", "duration_s", type=FiniteFloatRange(min=0.1), required=True, help="Seconds to record.")
@click.option("--interval", "interval_s", type=FiniteFloatRange(min=0.1), help="Seconds between samples (default 1).")
@one_line_errors
def record(config_path: str | None, out_path: str, duration_s: float, **flags: Any) -> None:
    """Record a trace from any backend (JSON lines; the format: docs/trace-format.md in the repository)."""
    from gpuwatch.node.recorder import record as run_record

    interval = flags.pop("interval_s") or 1.0
    config = build_config(config_path, **flags)
    counts = run_record(config, Path(out_path), duration_s, interval, progress=_progress)
    click.echo(f"\nwrote {out_path}: {counts['samples']} samples, {counts['events']} events, {counts['errors']} errors")


def _progress(done_s: float, total_s: float) -> None:
    click.echo(f"\rrecording {done_s:5.0f}/{total_s:.0f} s", nl=False, err=True)


@main.command()
@click.argument("trace_path", type=click.Path(dir_okay=False))
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file (rule thresholds).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@one_line_errors
def replay(trace_path: str, config_path: str | None, as_json: bool) -> None:
    """Run a trace through the rules and the state machine."""
    from gpuwatch.backends.trace import read_trace
    from gpuwatch.node.offline import replay as run_replay

    started = time.perf_counter()
    results = run_replay(read_trace(Path(trace_path)), load(config_path, known_rules=_rule_names()))
    if as_json:
        click.echo(json.dumps({"gpus": [r.as_dict() for r in results]}, indent=2))
        return
    for r in results:
        click.echo(
            f"GPU {r.index} {r.uuid}: worst {r.worst_state.value}, final {r.final_state.value}, "
            f"quarantined {'yes' if r.quarantined else 'no'}, {len(r.findings)} finding(s)"
        )
        for f in r.findings:
            click.echo(f"  t={f['t']:.1f} {f['rule']} ({f['severity']}, action {f['action']})")
    click.echo(f"replayed in {time.perf_counter() - started:.2f} s", err=True)


@main.command()
@click.argument("index", type=int)
@click.option("--reason", required=True, help="Why (kept with the quarantine and shown to operators).")
@config_options
@one_line_errors
def quarantine(index: int, reason: str, config_path: str | None, **flags: Any) -> None:
    """Quarantine GPU INDEX: trainers on it are asked to checkpoint and leave."""
    from gpuwatch.serving.client import DaemonClient

    g = DaemonClient(build_config(config_path, **flags), config_path=config_path).quarantine(index, reason)
    click.echo(g.message or f"GPU {g.index} quarantined (epoch {g.epoch}): {g.quarantine_reason}")


@main.command()
@click.argument("index", type=int)
@click.option("--reason", default="operator", show_default=True, help="Why the GPU may be used again.")
@click.option("--force", is_flag=True, help="Release it even while it is still degraded or unhealthy.")
@click.option("--validate", is_flag=True, help="Run the GPU test first; release only if it passes (exit 1 if not).")
@config_options
@one_line_errors
def release(index: int, reason: str, force: bool, validate: bool, config_path: str | None, **flags: Any) -> None:
    """Release GPU INDEX from quarantine (a GPU still degraded or unhealthy needs --force)."""
    from gpuwatch.errors import DaemonError
    from gpuwatch.serving.client import DaemonClient

    config = build_config(config_path, **flags)
    wait_s = config.validation.timeout_s * 2 + 30 if validate else None  # the GPU test, then dcgmi diag
    try:
        g = DaemonClient(config, config_path=config_path).release(index, reason, force, validate_timeout_s=wait_s)
    except DaemonError as exc:
        if validate and "HTTP 409" in str(exc):  # the test failed or could not run: still quarantined
            click.echo(f"gpuwatch: {exc}", err=True)
            raise SystemExit(1) from None
        raise
    click.echo(g.message or f"GPU {g.index} released; state {g.state}")
    if validate and g.validation is not None:
        click.echo(f"validation {g.validation.outcome}: {g.validation.reason}")
