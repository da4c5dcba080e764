"""The operator's commands against a real daemon process (sim, 4 GPUs, listening on a host name):
what they print, what they refuse, and how they find the daemon and its control socket.

One daemon for the module; each test works on its own GPU.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, run_gpuwatch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("operator")
    args = ("--sim-scenario", "healthy", "--sim-gpus", "4", "--interval", "1")
    with DaemonProcess(tmp, *args, host="localhost") as running:
        yield running


def one_line(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert result.returncode == code, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_status_piped_shows_one_gpu_per_line_in_full(daemon: DaemonProcess) -> None:
    result = daemon.cli("status")
    assert result.returncode == 0, result.stderr
    uuids = [g["uuid"] for g in daemon.get("/v1/gpus")["gpus"]]
    lines = result.stdout.splitlines()
    assert [line.split(", ")[:2] for line in lines] == [[f"GPU {i}", f"UUID: {u}"] for i, u in enumerate(uuids)]
    assert all("state: healthy, quarantined: no" in line for line in lines)
    assert "…" not in result.stdout


def test_status_wide_is_the_table_at_full_width(daemon: DaemonProcess) -> None:
    reason = "[bold]fan[/] noise at 3x the usual"  # an operator's text: shown as written, never as markup
    assert daemon.cli("quarantine", "3", "--reason", reason).returncode == 0
    result = daemon.cli("status", "--wide")
    assert daemon.cli("release", "3").returncode == 0
    assert result.returncode == 0, result.stderr
    assert "quarantined" in result.stdout and "…" not in result.stdout
    assert all(g["uuid"] in result.stdout for g in daemon.get("/v1/gpus")["gpus"])
    assert f"yes: {reason}" in result.stdout


def test_quarantine_and_release_say_what_they_did(daemon: DaemonProcess) -> None:
    steps = [
        (["quarantine", "1", "--reason", "fan noise"], "GPU 1 quarantined (epoch 1): fan noise"),
        (
            ["quarantine", "1", "--reason", "again"],
            "GPU 1 was already quarantined by an operator: nothing changed; the reason stays 'fan noise' "
            "(release it first)",
        ),
        (["release", "1"], "GPU 1 released; state healthy"),
        (["release", "1"], "GPU 1 was not quarantined: nothing changed"),
    ]
    for args, said in steps:
        result = daemon.cli(*args)
        assert (result.returncode, result.stdout.strip()) == (0, said), result.stderr


def test_release_of_an_unhealthy_gpu_needs_force(daemon: DaemonProcess) -> None:
    token = (daemon.state_dir / "token").read_text().strip()
    inject = urllib.request.Request(
        f"{daemon.url}/v1/gpus/0/inject",
        data=json.dumps({"event": "xid", "xid": 79}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(inject, timeout=5).close()
    assert daemon.get("/v1/gpus/0")["quarantined"] is True
    line = one_line(daemon.cli("release", "0"))
    assert "HTTP 409: GPU 0 is still unhealthy: xid_critical (unhealthy): " in line
    assert line.endswith("(gpuwatch release 0 --force)")
    assert daemon.get("/v1/gpus/0")["quarantined"] is True
    forced = daemon.cli("release", "0", "--force", "--reason", "reseated")
    assert (forced.returncode, forced.stdout.strip()) == (0, "GPU 0 released; state unhealthy"), forced.stderr
    assert daemon.get("/v1/gpus/0")["quarantined"] is False


def test_commands_find_the_daemon_through_the_config_file(daemon: DaemonProcess, tmp_path: Path) -> None:
    config = tmp_path / "gpuwatch.toml"
    config.write_text(f'listen = "localhost:{daemon.port}"\nstate_dir = "{daemon.state_dir}"\n')
    from_env = run_gpuwatch("quarantine", "2", "--reason", "by config", env={"GPUWATCH_CONFIG": str(config)})
    assert from_env.stdout.strip() == "GPU 2 quarantined (epoch 1): by config", from_env.stderr
    from_flag = run_gpuwatch("release", "2", "--config", str(config))
    assert from_flag.stdout.strip() == "GPU 2 released; state healthy", from_flag.stderr
    listed = run_gpuwatch("drill", "--inject", "gpu=2,preset=xid79", "--dry-run", "--config", str(config))
    assert listed.returncode == 0 and "dry run: nothing was done" in listed.stdout, listed.stderr


def test_without_the_control_socket_each_command_says_what_to_pass(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The daemon's TCP port answers, but a state change never goes there: it needs the control socket."""
    elsewhere = ["--listen", f"localhost:{daemon.port}", "--state-dir", str(tmp_path / "no-state")]
    for args in (["quarantine", "3", "--reason", "x"], ["drill", "--inject", "gpu=3,preset=xid79"]):
        line = one_line(run_gpuwatch(*args, *elsewhere))
        assert f"cannot reach the gpuwatch daemon: no control socket at {tmp_path}/no-state/api.sock" in line
        assert "Pass --state-dir with the daemon's state dir, or --config with its config file" in line
    assert daemon.get("/v1/gpus/3")["quarantined"] is False, "the drill was refused before it injected anything"
    assert daemon.get("/v1/injections")["injections"] == []


def test_without_a_daemon_the_error_names_the_config_used(tmp_path: Path) -> None:
    config = tmp_path / "gpuwatch.toml"
    config.write_text('listen = "localhost:1"\n')
    line = one_line(run_gpuwatch("status", "--config", str(config)))
    assert line.startswith("gpuwatch: error: cannot reach the gpuwatch daemon at http://localhost:1: ")
    assert f"(config {config}); is it running? Pass --listen HOST:PORT, or --config" in line
