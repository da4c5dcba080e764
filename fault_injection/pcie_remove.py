#!/usr/bin/env python3
"""Remove one GPU from the PCIe bus through sysfs and rescan, guarded, and see it come back.

    python3 fault_injection/pcie_remove.py 0        # dry run
    python3 fault_injection/pcie_remove.py 0 --yes

The same guards and order as reset_gpu.py, with `1` written to
`<tools.sysfs_root>/bus/pci/devices/<bdf>/remove` and then to `<tools.sysfs_root>/bus/pci/rescan`
(the BDF from the daemon's pci_bus_id). Under systemd it needs systemd/pcie-drill.conf.
The same as `gpuwatch drill --pcie-remove GPU`; takes its options.
"""

from __future__ import annotations

import sys
from pathlib import Path

# From a checkout this file's repository comes first, installed or not; an install is used otherwise.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatch.drills.cli import run_as_script  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_as_script("--pcie-remove"))
