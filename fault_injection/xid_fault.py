#!/usr/bin/env python3
"""Raise a real, harmless XID 31 on one GPU from a sacrificial CUDA process (dry run unless --yes).

    python3 fault_injection/xid_fault.py --gpu 0          # dry run: print the plan
    python3 fault_injection/xid_fault.py --gpu 0 --yes    # do it

The program itself is gpuwatch/drills/xid_fault.py, which ships in the wheel (`python3 -m
gpuwatch.drills.xid_fault` on any install); its docstring says how the fault is made and guarded.
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout this file's repository comes first, installed or not; an install is used otherwise.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.drills.xid_fault import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
