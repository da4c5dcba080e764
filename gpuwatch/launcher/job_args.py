"""The job's command line as the user wrote it, to torchrun as the job's own.

torchrun parses its options with argparse, which takes an option after the script when it is a
prefix of one of torchrun's own (a script's `--log` is ambiguous between `--log-dir` and
`--logs-specs`; `--node` would become `--node-rank`). So the job goes after `--`, where argparse
takes nothing: `torchrun ... -- SCRIPT ARGS`, and for a module `torchrun ... -m -- MODULE ARGS`.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import click

from gpuwatch.base.command_error import OneLineCommand, command_name, fail

# The one-node rendezvous torchrun runs with (gpuwatch.launcher.local_rendezvous registers it under this
# name). Here, torch-free, so that `gpuwatch launch` starts without torch and says what is missing.
LOCAL_RENDEZVOUS = "gpuwatch-local"

MODULE_FLAGS = frozenset({"-m", "--module"})


def torchrun_job_args(command: Sequence[str]) -> list[str]:
    """`[-m] SCRIPT ARGS` as torchrun's arguments that it cannot mistake for its own options."""
    if command[0] in MODULE_FLAGS:
        return ["-m", "--", *command[1:]]
    return ["--", *command]


class LaunchCommand(OneLineCommand):
    """`gpuwatch launch -m MODULE` without `--`: one line that says what to type instead of "no such option -m"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes `args`
        try:
            return click.Command.parse_args(self, ctx, args)
        except click.NoSuchOption as exc:
            if exc.option_name in MODULE_FLAGS and exc.option_name in given and "--" not in given:
                at = given.index(exc.option_name)
                fixed = shlex.join([*given[:at], "--", *given[at:]])
                fail(f"the job goes after --: gpuwatch launch {fixed}", command=command_name(ctx))
            fail(exc.format_message(), command=command_name(ctx))
        except click.UsageError as exc:
            fail(exc.format_message(), command=command_name(ctx))
