#!/usr/bin/env python3
"""SIGKILL one trainer rank on a GPU, found through the daemon's rank map, and wait for the job to return.

    python3 fault_injection/kill_rank.py 0              # dry run: which rank would die
    python3 fault_injection/kill_rank.py 0 --rank 3 --yes

The rank comes from GET /v1/gpus (each GPU's trainers, with pid, rank and job id); a PID that started
after its trainer report was written is another process and is refused. After the kill the drill
waits for the process to exit, the daemon to drop it, and a new process of the same job and rank.
The same as `gpuwatch drill --kill-rank GPU`; takes its options.
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout this file's repository comes first, installed or not; an install is used otherwise.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.drills.cli import run_as_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_as_script("--kill-rank"))
