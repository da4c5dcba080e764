"""How a gpuwatch command ends on an error it expected: one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

import sys
from typing import NoReturn

import click


def fail(message: str, code: int = 2, command: str = "gpuwatch") -> NoReturn:
    """Print `<command>: error: <message>` on stderr and exit `code` (2 unless said otherwise).

    A negative code is a child killed by that signal (as subprocess reports it) and exits as a shell
    would show it, 128 + the signal.
    """
    click.echo(f"{command}: error: {message}", err=True)
    sys.exit(128 - code if code < 0 else code)
