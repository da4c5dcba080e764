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
from collections.abc import Sequence

from gpuwatch.drills.cli import run_as_script


def main(argv: Sequence[str] | None = None) -> int:
    """Run the drill with `argv` (default: sys.argv[1:]); returns its exit status."""
    return run_as_script("--inject", argv)


if __name__ == "__main__":
    sys.exit(main())
