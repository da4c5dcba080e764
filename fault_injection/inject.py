#!/usr/bin/env python3
"""Inject a fault into the running daemon through its API, and check what must follow.

    python3 fault_injection/inject.py 'gpu=1,sm_clock_mhz=500,clocks_event_reasons=0,util_gpu_pct=100,for=600'
    python3 fault_injection/inject.py 'gpu=0,preset=xid79'
    python3 fault_injection/inject.py 'gpu=2,error=gpu_lost,for=120' --dry-run

POST /v1/gpus/N/inject overrides the GPU's readings for `for` seconds and/or injects one event (XID,
ECC). Nothing on the card changes; every finding on that GPU meanwhile carries drill=true, and so do
its metrics, so Alertmanager routes them away from the pager. Then the drill checks the finding, the
alert metric, the quarantine, the trainers' stop, checkpoint and resume, and prints the verdict.
The same as `gpuwatch drill --inject SPEC`; takes its options (--config, --listen, --json, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout this file's repository comes first, installed or not; an install is used otherwise.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.drills.cli import run_as_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_as_script("--inject"))
