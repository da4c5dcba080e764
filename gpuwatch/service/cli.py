"""`gpuwatch service install | uninstall | assets`: one command per node, and the assets for its monitoring."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from gpuwatch.base.command_error import fail
from gpuwatch.errors import GpuwatchError
from gpuwatch.service.layout import Root, prefix_of

F = TypeVar("F", bound=Callable[..., Any])


def _placement(func: F) -> F:
    """--prefix and --root, and any gpuwatch error as one line with exit 2."""

    @click.option(
        "--prefix",
        metavar="VENV",
        help="The venv gpuwatch-daemon is installed in (default: the one this gpuwatch runs from).",
    )
    @click.option(
        "--root",
        "root_dir",
        type=click.Path(file_okay=False, exists=True),
        default="/",
        show_default=True,
        help="Install into this tree instead (an image being built); nothing is started there.",
    )
    @functools.wraps(func)
    def wrapper(prefix: str | None, root_dir: str, **kwargs: Any) -> Any:
        try:
            root = Root(Path(root_dir))
            return func(root=root, prefix=prefix_of(root, prefix), **kwargs)
        except GpuwatchError as exc:
            fail(str(exc), command="gpuwatch service")

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def service() -> None:
    """Install gpuwatch on this node as a systemd service, uninstall it, or copy the monitoring assets."""


@service.command()
@click.option("--now", is_flag=True, help="Also enable and start the service (systemctl enable --now).")
@click.option("--pcie-drill", is_flag=True, help="Also the drop-in that lets the pcie_remove drill write /sys.")
@click.option("--dry-run", is_flag=True, help="Print each file it would write, link or enable; change nothing.")
@_placement
def install(root: Root, prefix: Path, now: bool, pcie_drill: bool, dry_run: bool) -> None:
    """Put the unit, the example config (never over an edited one) and the command link in place, verify the
    unit with systemd-analyze; with --now enable and start it. Run as root.

    With --root DIR (an image being built, or an empty directory to try it in) the venv must be inside DIR;
    the units are verified only when DIR has systemd's own units (usr/lib/systemd/system)."""
    from gpuwatch.service.install import install as run_install

    run_install(root, prefix, now=now, pcie_drill=pcie_drill, say=click.echo, dry_run=dry_run)


@service.command()
@click.option("--purge", is_flag=True, help="Also edited files and the state, cache and runtime directories.")
@_placement
def uninstall(root: Root, prefix: Path, purge: bool) -> None:
    """Undo what `service install` did: stop and disable the service, remove its files. Run as root."""
    from gpuwatch.service.install import uninstall as run_uninstall

    run_uninstall(root, prefix, purge=purge, say=click.echo)


@service.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to copy them into.")
@click.option("--runbook-url", help="Where the runbook is published; default: the copy written into --out.")
@_placement
def assets(root: Root, prefix: Path, out_dir: str, runbook_url: str | None) -> None:
    """Copy the alert and recording rules, the Alertmanager and Prometheus examples, the Grafana dashboard and
    the runbook, for the host that runs Prometheus and Grafana."""
    from gpuwatch.service.assets import copy_assets

    for path in copy_assets(root / prefix, Path(out_dir), runbook_url):
        click.echo(f"wrote {path}")
