"""`gpuwatch drill`: run one drill against the running daemon, show each step as it runs, print the
verdict and hand it to the daemon to store and export.

Exit status: 0 the drill passed (or a dry run), 1 it failed, 2 it was refused or misused. Drills that
do something real (kill a rank, raise an XID, reset or unplug a GPU) only print their plan unless
--yes is given.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import click

from gpuwatch.base.command_error import OneLineCommand, fail
from gpuwatch.config import Config, load
from gpuwatch.drills.steps import FAIL, PASS, Clock, Progress, Verdict
from gpuwatch.errors import DaemonError, GpuwatchError

if TYPE_CHECKING:
    from rich.console import Console

    from gpuwatch.drills.runner import Request

# The runner, the API client and the specs are imported when a drill runs, so that registering this
# command costs `gpuwatch status` and friends nothing at start.

_MARKS = {PASS: "pass", FAIL: "FAIL", "skip": "skip", "not_run": "not run"}


class _GpuOrAll(click.ParamType):
    """--clear's optional value: a GPU index, or "all" when the option is given alone."""

    name = "GPU"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if value == "all" or isinstance(value, int):
            return value
        if not str(value).isdigit():
            self.fail(f"{value!r} is not a GPU index", param, ctx)
        return int(value)


@click.command("drill", cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--inject", "inject_spec", metavar="SPEC", help="e.g. 'gpu=1,sm_clock_mhz=500,for=600' or 'gpu=0,preset=xid79'."
)
@click.option("--dcgm-inject", "dcgm_spec", metavar="SPEC", help="e.g. 'gpu=0,field=230,value=79' (dcgm backend).")
@click.option(
    "--xid-fault", type=click.IntRange(min=0), metavar="GPU", help="Raise a real XID 31 on GPU (needs --yes)."
)
@click.option("--kill-rank", type=click.IntRange(min=0), metavar="GPU", help="SIGKILL a trainer rank on GPU (--yes).")
@click.option("--hang-rank", type=click.IntRange(min=0), metavar="GPU", help="SIGSTOP a trainer rank on GPU (--yes).")
@click.option(
    "--fault-rank", type=click.IntRange(min=0), metavar="GPU", help="A rank on GPU raises a real XID 31 (--yes)."
)
@click.option("--reset-gpu", type=click.IntRange(min=0), metavar="GPU", help="nvidia-smi -r the GPU (needs --yes).")
@click.option("--pcie-remove", type=click.IntRange(min=0), metavar="GPU", help="sysfs remove + rescan (needs --yes).")
@click.option(
    "--validate", type=click.IntRange(min=0), metavar="GPU", help="Run the GPU test on an idle GPU (needs --yes)."
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    help="--kill-rank, --hang-rank, --fault-rank: which rank (default: the lowest on the GPU).",
)
@click.option(
    "--list", "show_list", is_flag=True, help="List drill kinds and the next scheduled runs; no daemon needed."
)
@click.option(
    "--clear",
    type=_GpuOrAll(),
    is_flag=False,
    flag_value="all",
    metavar="[GPU]",
    help="End the injections in force now, on GPU or (without one) on every GPU.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan, check the guards, change nothing.")
@click.option("--yes", is_flag=True, help="Really do a drill that kills, faults, resets or unplugs something.")
@click.option("--await-release", is_flag=True, help="Also wait for the burn-in release after a quarantine.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--listen", help="HOST:PORT of the daemon's API (default 127.0.0.1:9835).")
@click.option("--state-dir", help="Where the daemon's control socket lives (default /var/lib/gpuwatch).")
def drill(
    inject_spec: str | None,
    dcgm_spec: str | None,
    xid_fault: int | None,
    kill_rank: int | None,
    hang_rank: int | None,
    fault_rank: int | None,
    reset_gpu: int | None,
    pcie_remove: int | None,
    validate: int | None,
    rank: int | None,
    show_list: bool,
    clear: int | str | None,
    dry_run: bool,
    yes: bool,
    await_release: bool,
    as_json: bool,
    config_path: str | None,
    listen: str | None,
    state_dir: str | None,
) -> None:
    """Inject a fault and check that detection, alerting, quarantine and resume follow in time."""
    from gpuwatch.drills.runner import Request
    from gpuwatch.drills.spec import KINDS

    chosen = [
        (name, value)
        for name, value in (
            ("inject", inject_spec),
            ("dcgm_inject", dcgm_spec),
            ("xid_fault", xid_fault),
            ("kill_rank", kill_rank),
            ("hang_rank", hang_rank),
            ("fault_rank", fault_rank),
            ("reset_gpu", reset_gpu),
            ("pcie_remove", pcie_remove),
            ("validate", validate),
        )
        if value is not None
    ]
    if len(chosen) + show_list + (clear is not None) != 1:
        fail("give one of --list, --clear, " + ", ".join(k.option for k in KINDS.values()))
    try:
        config = load(config_path, overrides={"listen": listen, "state_dir": state_dir})
        if show_list:
            _list(config, datetime.now(timezone.utc))
            return
        if clear is not None:
            _clear(config, clear if isinstance(clear, int) else None, config_path)
            return
        name, value = chosen[0]
        spec = value if isinstance(value, str) else ""
        request = Request(
            name, value if isinstance(value, int) else None, spec, rank, await_release or config.drills.await_release
        )
        code = _drill(config, request, dry_run or (KINDS[name].needs_yes and not yes), as_json, config_path)
    except GpuwatchError as exc:
        fail(str(exc))
    sys.exit(code)


def run_as_script(option: str, argv: Sequence[str] | None = None) -> int:
    """fault_injection/<name>.py ARG [options] is `gpuwatch drill <option> ARG [options]`; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    # --help alone, else it would be taken for the option's value ("--inject --help").
    command = ["--help"] if {"-h", "--help"} & set(args) else [option, *args]
    try:
        drill.main(args=command, prog_name=f"gpuwatch drill {option}", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def _drill(config: Config, request: Request, dry_run: bool, as_json: bool, config_path: str | None = None) -> int:
    from gpuwatch.drills.daemon_client import HttpApi
    from gpuwatch.drills.runner import plan, prepare, run_drill

    api = HttpApi(config, config_path=config_path)
    run = prepare(request, api, config, Clock(time.time, time.sleep, config.drills.poll_s))
    title = f"drill {run.kind.name} on GPU {run.gpu} ({run.uuid})"
    if dry_run:
        click.echo(f"plan: {title}")
        for line in plan(run):
            click.echo(f"  {line}")
        hint = "; add --yes to do it" if run.kind.needs_yes else ""
        click.echo(f"dry run: nothing was done{hint}")
        return 0
    api.require_control()  # refused (exit 2, saying what to do) before the drill, not a FAIL at its first step
    from rich.console import Console  # here: registering the command (`gpuwatch run`) never loads rich

    console = Console(stderr=True)
    with console.status(title) as status:
        verdict = run_drill(run, _progress(title, console, status.update, time.time()))
    _print(verdict, title, as_json)
    try:
        api.post("/v1/drills", verdict.as_dict())
    except DaemonError as exc:
        click.echo(f"gpuwatch: warning: the daemon did not store the verdict: {exc}", err=True)
    return 0 if verdict.result == PASS else 1


def _progress(title: str, console: Console, update: Callable[[str], None], started: float) -> Progress:
    """Show the step and its elapsed time: a live line on a terminal, one line per step elsewhere."""
    shown: list[str] = []

    def progress(step: str, elapsed: float, deadline: float | None) -> None:
        limit = f" of {deadline:g}" if deadline is not None else ""
        if console.is_terminal:
            update(f"{title} · {time.time() - started:.0f} s · step {step}: {elapsed:.1f}{limit} s")
        elif not shown or shown[-1] != step:
            shown.append(step)
            click.echo(f"step {step}...", err=True)

    return progress


def _print(verdict: Verdict, title: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(verdict.as_dict(), indent=2))
        return
    took = verdict.finished - verdict.started
    click.echo(f"{title}: {verdict.result.upper()} in {took:.1f} s")
    for step in verdict.steps:
        duration = f"{step.duration_s:8.2f} s" if step.result in (PASS, FAIL) else f"{'-':>10}"
        click.echo(f"  {_MARKS[step.result]:<8} {step.name:<24} {duration}  {step.detail}")
    if verdict.broke_at:
        failed = next(s for s in verdict.steps if s.name == verdict.broke_at)
        click.echo(f"drill {verdict.drill} FAILED at step {failed.name}: {failed.detail}", err=True)


def _clear(config: Config, gpu: int | None, config_path: str | None) -> None:
    """End the injections in force (on `gpu`, else on every GPU) now, one line for each; or say there was none."""
    from gpuwatch.serving.client import DaemonClient

    client = DaemonClient(config, config_path=config_path)
    client.require_control()
    now = time.time()
    listed = [i for i in client.injections() if gpu is None or i.gpu == gpu]
    if not listed:
        click.echo(f"no injection in force on {'any GPU' if gpu is None else f'GPU {gpu}'}: nothing changed")
    for injection in listed:
        client.end_injection(injection.id)
        fields = ",".join(f"{k}={v}" for k, v in injection.fields.items())
        left = f"{max(0.0, injection.until - now):.0f} s early"
        click.echo(f"ended injection {injection.id} on GPU {injection.gpu} ({fields}) {left}")


def _list(config: Config, now: datetime) -> None:
    from gpuwatch.drills.scheduler import entries, next_runs
    from gpuwatch.drills.spec import KINDS, PRESETS

    click.echo("drill kinds (--yes: dry run without it; destructive: a schedule needs allow_destructive = true):")
    for kind in KINDS.values():
        flags = ", ".join(f for f, on in (("--yes", kind.needs_yes), ("destructive", kind.destructive)) if on)
        usage = f"{kind.option} {'SPEC' if kind.name.endswith('inject') else 'GPU'}"
        click.echo(f"  {kind.name:<12} {usage:<19} {kind.summary}" + (f" [{flags}]" if flags else ""))
    click.echo("--inject presets: " + "; ".join(f"{n} ({_spec(p)})" for n, p in PRESETS.items()))
    scheduled = entries(config)
    if not scheduled:
        click.echo("no scheduled drills ([[drills.schedule]] in the config)")
        return
    click.echo("scheduled drills (UTC):")
    for entry in scheduled:
        s = entry.schedule
        upcoming = ", ".join(t.strftime("%Y-%m-%d %H:%M") for t in next_runs(entry, now)) or "never"
        args = f", args {s.args!r}" if s.args else ""
        click.echo(f"  [{entry.number}] {s.drill} on GPU {s.gpu}, cron {s.cron!r}{args}: next {upcoming}")


def _spec(values: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())
