"""Everything a drill does outside the daemon: run nvidia-smi and dcgmi, write sysfs, kill a process,
start the sacrificial CUDA process, read the kernel log.

Every path comes from `[tools]`, so tests point them at fakes that record what they were asked.
Each function either does its one thing and says what happened, or raises DrillError.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import psutil

from gpuwatch.base.tools import run_tool
from gpuwatch.config import Config
from gpuwatch.errors import DrillError

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def compute_pids(nvidia_smi: str, uuid: str) -> list[int]:
    """The PIDs nvidia-smi lists as compute applications on the GPU with `uuid`."""
    argv = [nvidia_smi, "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"]
    out = run_tool(argv, 120.0, error=DrillError, setting="tools.nvidia_smi", check=True).stdout
    found = []
    for line in out.splitlines():
        gpu_uuid, _, pid = line.partition(",")
        if gpu_uuid.strip() == uuid and pid.strip().isdigit():
            found.append(int(pid))
    return sorted(found)


def reset_gpu(nvidia_smi: str, index: int) -> str:
    """`nvidia-smi -r -i N`: a function-level reset of one GPU."""
    argv = [nvidia_smi, "-r", "-i", str(index)]
    lines = run_tool(argv, 300.0, error=DrillError, setting="tools.nvidia_smi", check=True).stdout.strip().splitlines()
    return f"{' '.join(argv)}: {lines[-1] if lines else 'done'}"


def dcgm_inject(dcgmi: str, gpu: int, field_id: int, value: float) -> str:
    """`dcgmi test --inject`; --gpuid always, since dcgmi defaults to GPU 1."""
    shown = str(int(value)) if value.is_integer() else str(value)
    argv = [dcgmi, "test", "--inject", "--gpuid", str(gpu), "-f", str(field_id), "-v", shown]
    lines = run_tool(argv, 120.0, error=DrillError, setting="tools.dcgmi", check=True).stdout.strip().splitlines()
    return f"{' '.join(argv)}: {lines[-1] if lines else 'done'}"


def pci_address(bus_id: str) -> str:
    """NVML's `00000000:18:00.0` as sysfs names it, `0000:18:00.0`."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    address = f"{domain[-4:]}:{rest}"
    if not _BDF.match(address):
        raise DrillError(f"PCI bus id {bus_id!r} is not DOMAIN:BUS:DEVICE.FUNCTION")
    return address


def pci_paths(sysfs_root: str, bus_id: str) -> tuple[Path, Path]:
    """The device's directory and the bus's rescan file, both checked to exist."""
    device = Path(sysfs_root) / "bus" / "pci" / "devices" / pci_address(bus_id)
    rescan = Path(sysfs_root) / "bus" / "pci" / "rescan"
    for path in (device / "remove", rescan):
        if not path.exists():
            raise DrillError(f"{path} does not exist")
    return device, rescan


def write_one(path: Path) -> str:
    """Write "1" to a sysfs attribute (remove, rescan)."""
    try:
        path.write_text("1")
    except OSError as exc:
        raise DrillError(f"cannot write 1 to {path}: {exc.strerror or exc}") from None
    return f"wrote 1 to {path}"


def signal_rank(pid: int, reported_t: float | None, sig: signal.Signals) -> str:
    """Send `sig` to `pid`, unless it started after its trainer report was written (the PID was reused)."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        raise DrillError(f"pid {pid} is gone already") from None
    if reported_t is not None and started > reported_t + 1.0:
        raise DrillError(f"pid {pid} started after its trainer report: it is another process now")
    try:
        os.kill(pid, sig)
    except OSError as exc:
        raise DrillError(f"cannot send {sig.name} to pid {pid}: {exc.strerror or exc}") from None
    return f"sent {sig.name} to pid {pid}"


def running(pid: int) -> bool:
    """True while `pid` runs (a zombie has ended)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def xid_script(config: Config) -> Path:
    """The sacrificial process: `tools.xid_fault` when set, else xid_fault.py beside this module (in the wheel)."""
    if config.tools.xid_fault:
        return Path(config.tools.xid_fault)
    return Path(__file__).resolve().with_name("xid_fault.py")


def run_xid_fault(script: Path, gpu: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the sacrificial process with --yes; its JSON report when the child died of the fault."""
    argv = [sys.executable, str(script), "--gpu", str(gpu), "--yes", "--timeout", f"{timeout_s:g}"]
    done = run_tool(argv, timeout_s + 30.0, error=DrillError, setting="tools.xid_fault")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        why = said[-1] if said else f"child exit {report.get('returncode')}"
        raise DrillError(f"{script.name} exited {done.returncode}: {why}")
    return report


def kernel_xid_line(kmsg: str, pid: int) -> str | None:
    """The driver's `NVRM: Xid ... pid=PID,` line in the kernel log, or None.

    Raises:
        OSError: the log cannot be read (no permission, no such file).
    """
    fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:  # /dev/kmsg: no more records
                break
            except BrokenPipeError:  # /dev/kmsg: records were overwritten while reading; go on
                continue
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        if "NVRM: Xid" in line and f"pid={pid}," in line:
            return line.partition(";")[2] or line
    return None
