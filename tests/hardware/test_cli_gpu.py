"""The CLI and the daemon on real GPUs: `gpuwatch check`, `gpuwatch record`, and a real XID 31 seen by the daemon.

Run on a GPU node with GPUWATCH_TEST_GPU=1 and `-s` to see the figures. Nothing here changes a GPU
setting: the XID comes from fault_injection/xid_fault.py's sacrificial process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, run_gpuwatch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
XID_DEADLINE_S = 2.0


def gpuwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return run_gpuwatch(*args, timeout=120, cwd=ROOT)


def test_check_judges_the_real_gpus() -> None:
    result = gpuwatch("check", "--backend", "nvml", "--samples", "3", "--json")
    print(result.stdout, result.stderr)
    assert result.returncode in (0, 1), result.stderr
    gpus = json.loads(result.stdout)["gpus"]
    assert gpus and all(g["uuid"].startswith("GPU-") for g in gpus)
    assert result.returncode == (1 if any(g["state"] in {"degraded", "unhealthy"} for g in gpus) else 0)


def test_record_then_replay(tmp_path: Path) -> None:
    trace = tmp_path / "h200.jsonl"
    recorded = gpuwatch("record", "--backend", "nvml", "--out", str(trace), "--duration", "10", "--interval", "1")
    print(recorded.stdout, recorded.stderr[-300:])
    assert recorded.returncode == 0, recorded.stderr
    lines = trace.read_text().splitlines()
    header = json.loads(lines[0])
    samples = [json.loads(line) for line in lines[1:] if "sm_clock_mhz" in line]
    assert len(samples) >= 9 * len(header["static"])
    assert all(s["power_w"] and s["sm_clock_mhz"] for s in samples)
    replayed = gpuwatch("replay", str(trace), "--json")
    assert replayed.returncode == 0, replayed.stderr
    print(replayed.stdout)
    assert all(g["worst_state"] == "healthy" for g in json.loads(replayed.stdout)["gpus"])


def test_daemon_flags_a_real_xid31_within_2s(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "--interval", "30", backend="nvml", cwd=ROOT)
    try:
        daemon.start()
        injector = subprocess.Popen(
            [sys.executable, str(ROOT / "fault_injection" / "xid_fault.py"), "--gpu", "0", "--yes"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        seen_t = None
        deadline = time.time() + 60
        while time.time() < deadline and seen_t is None:
            gpu = daemon.get("/v1/gpus/0")
            if any(f["rule"].startswith("xid") for f in gpu["findings"]):
                seen_t = time.time()
            else:
                time.sleep(0.02)
        report = json.loads(injector.communicate(timeout=120)[0].strip().splitlines()[-1])
        assert seen_t is not None, "the daemon never flagged the XID"
        print(
            f"XID 31: fault process ran {report['exited_t'] - report['started_t']:.2f} s; "
            f"finding visible {seen_t - report['exited_t']:+.2f} s relative to its exit; findings {gpu['findings']}"
        )
        assert seen_t - report["exited_t"] <= XID_DEADLINE_S
        assert gpu["xids"] == {"31": 1}
        assert gpu["quarantined"] is False, "one application XID does not condemn the card"
    finally:
        daemon.stop()
        print(daemon.log_text()[-2000:])
