"""How a gpuwatch command ends on an error it expected: one line on stderr and an exit code, never a traceback.

Click's own answer to a bad flag is a usage block of several lines; Slurm, cron and systemd read
the first line of stderr, so every gpuwatch command answers a bad flag with one line too.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NoReturn

import click


def fail(message: str, code: int = 2, command: str = "gpuwatch") -> NoReturn:
    """Print `<command>: error: <message>` on stderr and exit `code` (2 unless said otherwise).

    A negative code is a child killed by that signal (as subprocess reports it) and exits as a shell
    would show it, 128 + the signal.
    """
    click.echo(f"{command}: error: {message}", err=True)
    sys.exit(128 - code if code < 0 else code)


def command_name(ctx: click.Context) -> str:
    """`gpuwatch check`: how the user called the command, also when a test calls the click object directly."""
    names: list[str] = []
    here: click.Context | None = ctx
    while here is not None:
        names.insert(0, here.info_name or "")
        here = here.parent
    if not names[0].startswith("gpuwatch"):
        names[0] = "gpuwatch" if isinstance(ctx.find_root().command, click.Group) else f"gpuwatch {names[0]}"
    return " ".join(names)


class OneLineCommand(click.Command):
    """A bad flag or argument is one line naming it and exit 2, not click's usage block."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            fail(exc.format_message(), command=command_name(ctx))


class OneLineGroup(click.Group):
    """A group whose commands (and whose own unknown-command error) answer bad usage in one line."""

    command_class = OneLineCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            fail(exc.format_message(), command=command_name(ctx))

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            fail(exc.format_message(), command=command_name(ctx))


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses nan (which passes every comparison) and ±inf before the range check."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)
