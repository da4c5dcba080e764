"""Where the job and the monitors run: the job on a CPU of its own, near its GPU; everything else elsewhere.

The question is what a monitor's NVML calls and driver work cost the job, not what sharing a CPU
costs it: on a training node each rank is bound to its own cores (torchrun, Slurm's --cpu-bind, NUMA
binding) and a node daemon runs on the others. So the job is pinned to one CPU, the last one this
process may use among those local to the GPU (sysfs local_cpulist, where the job's memory and
interrupts live); that CPU's SMT siblings are left idle, so no monitor shares its core; the bench
itself and every monitor it starts (they inherit it) run on the remaining CPUs. With a single CPU
nothing is pinned, and the result says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_PCI = Path("/sys/bus/pci/devices")


@dataclass(frozen=True)
class Placement:
    """The job's CPU (None: not pinned), its idle SMT siblings, and the CPUs of the bench and the monitors."""

    job: int | None
    idle: frozenset[int]
    others: frozenset[int]
    why: str

    def as_dict(self) -> dict[str, object]:
        return {"job_cpu": self.job, "idle_cpus": cpu_list(self.idle), "monitor_cpus": cpu_list(self.others)}


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The kernel's CPU list format for `cpus`, runs joined ("0-3,8")."""
    ordered, parts, i = sorted(cpus), [], 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def place(pci_bus_id: str = "", sys_cpu: Path = SYS_CPU, sys_pci: Path = SYS_PCI) -> Placement:
    """Choose the job's CPU for a GPU at `pci_bus_id` (NVML's form, "00000000:00:06.0"; "" for none)."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        return Placement(None, frozenset(), frozenset(allowed), "one CPU only: nothing pinned")
    local = allowed & _read_list(sys_pci / _sysfs_bus_id(pci_bus_id) / "local_cpulist") if pci_bus_id else set()
    job = max(local or allowed)
    siblings = (_read_list(sys_cpu / f"cpu{job}" / "topology" / "thread_siblings_list") & allowed) - {job}
    others = allowed - {job} - siblings
    if not others:  # two CPUs that are one core's threads: the sibling has to take the monitors
        others, siblings = allowed - {job}, set()
    near = "local to the GPU" if local else "of this process"
    why = f"job on CPU {job} (the last {near}), its SMT siblings idle, the bench and the monitors on the others"
    return Placement(job, frozenset(siblings), frozenset(others), why)


def _sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:00:06.0" as sysfs names it, "0000:00:06.0"."""
    domain, _, rest = nvml_bus_id.lower().partition(":")
    return f"{domain[-4:]}:{rest}"


def _read_list(path: Path) -> set[int]:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return set()
