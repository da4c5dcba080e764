"""The CLI as users run it: real processes, exit codes, one-line errors, the daemon under NOTIFY_SOCKET."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, run_gpuwatch
from tests.helpers import HEALTHY_TRACE


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_replay_shared_healthy_trace_is_healthy_throughout() -> None:
    result = run_gpuwatch("replay", str(HEALTHY_TRACE), "--json")
    assert result.returncode == 0, result.stderr
    (gpu,) = json.loads(result.stdout)["gpus"]
    assert gpu["worst_state"] == "healthy" and gpu["final_state"] == "healthy"
    assert gpu["quarantined"] is False
    assert [f for f in gpu["findings"] if f["severity"] in {"degraded", "unhealthy"}] == []


@pytest.mark.slow
def test_record_then_replay_a_faulty_sim(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    recorded = run_gpuwatch(
        "record",
        "--backend",
        "sim",
        "--sim-gpus",
        "2",
        "--sim-scenario",
        "row_remap_pending",
        "--out",
        str(trace),
        "--duration",
        "13",
        "--interval",
        "1",
    )
    assert recorded.returncode == 0, recorded.stderr
    assert "wrote" in recorded.stdout
    replayed = json.loads(run_gpuwatch("replay", str(trace), "--json").stdout)
    states = {g["index"]: (g["worst_state"], [f["rule"] for f in g["findings"]]) for g in replayed["gpus"]}
    assert states[0] == ("healthy", [])
    assert states[1] == ("unhealthy", ["row_remap_pending"])
    checked = run_gpuwatch("check", "--backend", "replay", "--replay-file", str(trace), "--samples", "13")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "row_remap_pending" in checked.stdout


@pytest.mark.parametrize("where", ["/proc/x/y", "missing/t.jsonl", "/proc/self/status"])
def test_record_to_a_path_it_cannot_write_is_one_line_exit_2(tmp_path: Path, where: str) -> None:
    out = where if where.startswith("/") else str(tmp_path / where)
    recorded = run_gpuwatch("record", "--backend", "sim", "--out", out, "--duration", "0.2")
    assert recorded.returncode == 2, recorded.stderr
    assert recorded.stderr.startswith(f"gpuwatch: error: --out {out}") and recorded.stderr.count("\n") == 1, (
        recorded.stderr
    )


def test_check_healthy_sim_exits_zero() -> None:
    result = run_gpuwatch("check", "--backend", "sim", "--sim-scenario", "healthy", "--sim-gpus", "2", "--samples", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" healthy:") == 2


def test_auto_backend_without_gpu_names_sim(tmp_path: Path) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    result = run_gpuwatch("check", "--state-dir", str(tmp_path))
    assert_one_line_error(result, "--backend sim")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("interval_s = \n", "invalid TOML"),
        ("[sim]\ngpus = 'x'\n", "key sim.gpus"),
        ("bogus = 1\n", "key bogus: unknown key"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert_one_line_error(run_gpuwatch("run", "--config", str(path)), str(path), fragment)


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (["not json"], ":1:"),
        (['{"format": "gpuwatch-trace", "version": 1, "static": [{"index": 0, "uuid": "GPU-x"}]}', '{"t": 1}'], ":2:"),
    ],
)
def test_bad_trace_is_one_line_exit_2(tmp_path: Path, lines: list[str], fragment: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert_one_line_error(run_gpuwatch("replay", str(path)), str(path) + fragment)


def test_bad_flag_is_exit_2() -> None:
    result = run_gpuwatch("run", "--interval", "fast")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_client_commands_without_daemon_say_so(tmp_path: Path) -> None:
    result = run_gpuwatch("status", "--listen", "127.0.0.1:1", "--state-dir", str(tmp_path))
    assert_one_line_error(result, "cannot reach the gpuwatch daemon")


@pytest.mark.slow
def test_daemon_notifies_ready_after_first_sample_and_pings_watchdog(tmp_path: Path) -> None:
    notify_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(20)
    env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "10000000"}
    daemon = DaemonProcess(tmp_path, "--sim-gpus", "2", "--interval", "1", env=env)
    try:
        daemon.start()
        messages: list[str] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sum("WATCHDOG=1" in m for m in messages) < 2:
            messages.append(listener.recv(4096).decode())
        assert messages[0].startswith("READY=1") or "READY=1" in messages[0], messages
        assert (tmp_path / "run" / "status.json").exists(), "READY=1 only after the first complete sample"
        assert sum("WATCHDOG=1" in m for m in messages) >= 2, messages
        returncode = daemon.stop()
        assert any("STOPPING=1" in listener.recv(4096).decode() for _ in range(5))
    finally:
        daemon.stop()
        listener.close()
    assert returncode == 0, daemon.log_text()
