#!/usr/bin/env python3
"""Inject a value into DCGM's cache with `dcgmi test --inject`, and check what must follow.

    python3 fault_injection/dcgm_inject.py 'gpu=0,field=230,value=79'

Runs `<tools.dcgmi> test --inject --gpuid N -f FIELD -v VALUE`, always with --gpuid (dcgmi defaults
to GPU 1). Only a daemon on the dcgm backend sees it, and only until DCGM's next real sample.
The same as `gpuwatch drill --dcgm-inject SPEC`; takes its options.
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout this file's repository comes first, installed or not; an install is used otherwise.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.drills.cli import run_as_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_as_script("--dcgm-inject"))
