"""A launch's ranks get the hard descriptor limit (idle connections from others cannot exhaust a gloo rank)."""

from __future__ import annotations

import subprocess
import sys


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one_and_children_inherit_it() -> None:
    code = (
        "import resource, subprocess, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from gpuwatch.launcher.limits import raise_descriptor_limit\n"
        "before, after = raise_descriptor_limit()\n"
        "ask = 'import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE))'\n"
        "child = subprocess.run([sys.executable, '-c', ask], capture_output=True, text=True).stdout.strip()\n"
        "print(before, after, resource.getrlimit(resource.RLIMIT_NOFILE)[1], child)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 3)
    before, after, hard, child = int(out[0]), int(out[1]), int(out[2]), out[3].strip()
    assert before == 256 and after == hard > 256
    assert child == f"({hard}, {hard})"
