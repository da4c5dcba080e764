#!/usr/bin/env python3
"""Reset one GPU with `nvidia-smi -r -i N`, guarded, and see it come back.

    python3 fault_injection/reset_gpu.py 0          # dry run: the plan and what the guards say
    python3 fault_injection/reset_gpu.py 0 --yes

Refuses a GPU with processes that are not trainers (daemon and `nvidia-smi --query-compute-apps`).
Quarantines it through the API, waits for its trainers to checkpoint and leave, refuses again if any
process is left, asks the daemon to release its NVML handles, runs `<tools.nvidia_smi> -r -i N`,
hands the handles back (also when the reset failed), waits for the GPU to read again, and releases
it after `drills.burn_in_s` clean. Never run it on a machine whose GPUs you may not reset.
The same as `gpuwatch drill --reset-gpu GPU`; takes its options.
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout this file's repository comes first, installed or not; an install is used otherwise.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.drills.cli import run_as_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_as_script("--reset-gpu"))
