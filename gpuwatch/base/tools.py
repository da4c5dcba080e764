"""Running an outside program (nvidia-smi, dcgmi, scontrol) one way everywhere.

Bounded in time, output captured, and each way it can fail is one line that names the command and
the setting that points at the program, so an operator knows what to fix.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from gpuwatch.errors import GpuwatchError


def run_tool(
    argv: Sequence[str],
    timeout_s: float,
    *,
    error: type[GpuwatchError],
    setting: str,
    timeout_setting: str = "",
    what: str = "",
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` once; a missing, hung or unstartable program raises `error`, and so does a non-zero exit with `check`.

    `setting` is the config key holding the program's path (`tools.nvidia_smi`), `timeout_setting` the one
    holding `timeout_s`, where there is one; `what` names the command in messages (default: all of argv).
    """
    what = what or " ".join(argv)
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise error(f"{what}: {argv[0]} not found ({setting})") from None
    except subprocess.TimeoutExpired:
        hint = f" ({timeout_setting})" if timeout_setting else ""
        raise error(f"{what}: no answer within {timeout_s:g} s{hint}") from None
    except OSError as exc:
        raise error(f"{what}: cannot run {argv[0]}: {exc.strerror or exc}") from None
    if check and done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise error(f"{what}: exit {done.returncode}: {said[-1] if said else 'no output'}")
    return done
