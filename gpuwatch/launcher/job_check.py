"""Is the job's script or module there? Asked before torchrun starts, so a typo is one line, not a torchrun
traceback per rank and per relaunch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Run in a child with the job's own import path (its cwd first, as `python -m` has): the launcher's own
# sys.path starts at the gpuwatch script's directory. find_spec imports the parent packages only.
_FIND_MODULE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 1)"
_FIND_TIMEOUT_S = 60.0


def missing_job(command: Sequence[str], cwd: Path) -> str | None:
    """Why the job `[-m] SCRIPT ...` cannot start from `cwd` (one line), or None when its script or module is there."""
    if command[0] in {"-m", "--module"}:
        module = command[1]
        try:
            found = subprocess.run(
                [sys.executable, "-c", _FIND_MODULE, module],
                cwd=cwd,
                capture_output=True,
                timeout=_FIND_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot check that module {module!r} exists: {exc}"
        if found.returncode != 0:
            return f"no module named {module!r} for {sys.executable} in {cwd}: nothing started"
        return None
    script = Path(command[0])
    path = script if script.is_absolute() else cwd / script
    if path.is_file() or (path / "__main__.py").is_file():
        return None
    return f"{command[0]}: no such script in {cwd}: nothing started"
