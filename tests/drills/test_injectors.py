"""Every injector against fakes: fake nvidia-smi and dcgmi that record argv, a fake sysfs tree, a fake
kernel log, a stand-in for the sacrificial CUDA process, and real (harmless) child processes to kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.config import Config
from gpuwatch.drills import injectors
from gpuwatch.errors import DrillError
from tests.drills.conftest import Tools


def test_reset_runs_nvidia_smi_r_i_with_the_index(tools: Tools) -> None:
    detail = injectors.reset_gpu(str(tools.nvidia_smi), 3)
    assert tools.argv() == [["nvidia-smi", "-r", "-i", "3"]]
    assert "was successfully reset" in detail


def test_failed_reset_is_a_drill_error_with_the_tool_message(tools: Tools) -> None:
    tools.fail_reset()
    with pytest.raises(DrillError, match=r"-r -i 0: exit 3: Unable to reset GPU: In use by another client"):
        injectors.reset_gpu(str(tools.nvidia_smi), 0)


def test_compute_pids_reads_only_the_gpu_asked_for(tools: Tools) -> None:
    tools.apps.write_text("GPU-a, 101\nGPU-b, 202\nGPU-a, 303\n")
    assert injectors.compute_pids(str(tools.nvidia_smi), "GPU-a") == [101, 303]
    assert tools.argv() == [["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"]]


def test_missing_tool_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DrillError, match=r"/nowhere/nvidia-smi not found \(tools.nvidia_smi\)"):
        injectors.compute_pids("/nowhere/nvidia-smi", "GPU-a")


def test_dcgm_inject_always_passes_gpuid(tools: Tools) -> None:
    detail = injectors.dcgm_inject(str(tools.dcgmi), 0, 230, 79.0)
    assert tools.argv() == [["dcgmi", "test", "--inject", "--gpuid", "0", "-f", "230", "-v", "79"]]
    assert "Successfully injected" in detail
    injectors.dcgm_inject(str(tools.dcgmi), 2, 150, 91.5)
    assert tools.argv()[-1] == ["dcgmi", "test", "--inject", "--gpuid", "2", "-f", "150", "-v", "91.5"]


@pytest.mark.parametrize(
    ("bus_id", "address"), [("00000000:18:00.0", "0000:18:00.0"), ("0000:9A:00.1", "0000:9a:00.1")]
)
def test_pci_address_is_what_sysfs_calls_the_device(bus_id: str, address: str) -> None:
    assert injectors.pci_address(bus_id) == address


def test_pci_address_refuses_nonsense() -> None:
    with pytest.raises(DrillError, match="is not DOMAIN:BUS:DEVICE.FUNCTION"):
        injectors.pci_address("")


def test_sysfs_remove_and_rescan_write_one(tools: Tools) -> None:
    device, rescan = injectors.pci_paths(str(tools.sysfs), "00000000:1B:00.0")
    assert device == tools.sysfs / "bus/pci/devices/0000:1b:00.0"
    injectors.write_one(device / "remove")
    injectors.write_one(rescan)
    assert (device / "remove").read_text() == "1" and rescan.read_text() == "1"
    with pytest.raises(DrillError, match="0000:99:00.0/remove does not exist"):
        injectors.pci_paths(str(tools.sysfs), "00000000:99:00.0")


def test_kill_sends_sigkill_and_running_sees_the_end() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert injectors.running(child.pid)
        assert injectors.signal_rank(child.pid, time.time(), signal.SIGKILL) == f"sent SIGKILL to pid {child.pid}"
        assert child.wait(timeout=10) == -9
        assert not injectors.running(child.pid)
    finally:
        child.kill()


def test_kill_refuses_a_pid_that_started_after_its_report() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(DrillError, match="started after its trainer report"):
            injectors.signal_rank(child.pid, time.time() - 3600, signal.SIGKILL)
        assert child.poll() is None, "the process was not touched"
    finally:
        child.kill()
        child.wait()


def test_kernel_log_finds_the_line_of_the_child(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,100,1,-;eth0: link up\n"
        "4,101,2,-;NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000\n"
    )
    assert injectors.kernel_xid_line(str(kmsg), 4242) == (
        "NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000"
    )
    assert injectors.kernel_xid_line(str(kmsg), 424) is None
    with pytest.raises(OSError):
        injectors.kernel_xid_line(str(tmp_path / "none"), 1)


def _fake_xid_script(tmp_path: Path, returncode: int, child: int = 3) -> Path:
    script = tmp_path / "xid_fault.py"
    script.write_text(
        "import json, sys\n"
        "assert sys.argv[1:5] == ['--gpu', '2', '--yes', '--timeout'], sys.argv\n"
        f"print(json.dumps({{'gpu': 2, 'pid': 777, 'started_t': 1.0, 'exited_t': 2.5, 'returncode': {child}}}))\n"
        f"print('child said no', file=sys.stderr)\nsys.exit({returncode})\n"
    )
    return script


def test_xid_fault_report_comes_back(tmp_path: Path) -> None:
    report = injectors.run_xid_fault(_fake_xid_script(tmp_path, 0), 2)
    assert report == {"gpu": 2, "pid": 777, "started_t": 1.0, "exited_t": 2.5, "returncode": 3}


def test_xid_fault_that_did_not_fault_fails(tmp_path: Path) -> None:
    with pytest.raises(DrillError, match="xid_fault.py exited 1: child said no"):
        injectors.run_xid_fault(_fake_xid_script(tmp_path, 1, child=0), 2)


@pytest.mark.parametrize("where", ["package", "checkout"])
def test_the_real_xid_fault_refuses_without_a_gpu(where: str) -> None:
    """The shipped injector (the drill's default) and the checkout's script over it, here without any GPU:
    each refuses (exit 2) and says why in one line."""
    root = Path(__file__).resolve().parents[2]
    script = injectors.xid_script(Config()) if where == "package" else root / "fault_injection" / "xid_fault.py"
    assert script.is_file()
    done = subprocess.run([sys.executable, str(script), "--gpu", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("xid_fault: refused: "), done
    assert not [line for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    ("script", "option"),
    [
        ("inject", "--inject"),
        ("kill_rank", "--kill-rank"),
        ("reset_gpu", "--reset-gpu"),
        ("pcie_remove", "--pcie-remove"),
        ("dcgm_inject", "--dcgm-inject"),
        ("xid_fault", "--gpu"),
    ],
)
def test_each_fault_injection_script_runs_from_the_checkout(tmp_path: Path, script: str, option: str) -> None:
    """`python3 fault_injection/<name>.py` works from a checkout, from any directory and without PYTHONPATH."""
    path = Path(__file__).resolve().parents[2] / "fault_injection" / f"{script}.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    assert option in done.stdout
