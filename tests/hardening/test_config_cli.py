"""Bad config values and bad paths: one line naming the key or path, exit 2, never a traceback (issue 10 item 7)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch import config
from gpuwatch.cli import main
from gpuwatch.errors import ConfigError
from gpuwatch.serving.httpserver import FD_RESERVE
from tests.hardening.conftest import tmpfs
from tests.helpers import sim_config
from tests.service.test_systemd_unit import EXAMPLE_CONFIG, SYSTEMD_DIR, parse_unit


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("interval_s = nan", "interval_s: nan is not a finite number"),
        ("slow_interval_s = -5.0", "slow_interval_s: -5.0 must be positive"),
        ("findings_retention_days = -1.0", "findings_retention_days: -1.0 must be positive"),
        ("findings_retention_days = inf", "findings_retention_days: inf is not a finite number"),
        ("expected_gpus = -2", "expected_gpus: -2 is out of range"),
        ('state_dir = ""', "state_dir: must not be empty"),
        ('runtime_dir = "  "', "runtime_dir: must not be empty"),
        ("[rules]\nclock_window_s = nan", "rules.clock_window_s: nan is not a finite number"),
        ("[rules]\npower_window_s = inf", "rules.power_window_s: inf is not a finite number"),
        ("[rules]\nclock_low_ratio = 60.0", "rules.clock_low_ratio: 60.0 is out of range (0, 1]"),
        ("[rules]\nclock_low_ratio = -3.0", "rules.clock_low_ratio: -3.0 is out of range (0, 1]"),
        ("[rules]\nclock_busy_util_pct = 101", "rules.clock_busy_util_pct: 101 is out of range"),
        ("[rules]\nxid_app_repeats = 0", "rules.xid_app_repeats: 0 is out of range"),
        ("[policy]\nrecovery_s = -1.0", "policy.recovery_s: -1.0 must be 0 or more"),
        ("[policy]\nburn_in_s = -1.0", "policy.burn_in_s: -1.0 must be positive"),
        ("[policy]\nbreaker_window_s = nan", "policy.breaker_window_s: nan is not a finite number"),
        ("[trainer]\ngrace_period_s = -60.0", "trainer.grace_period_s: -60.0 must be 0 or more"),
        ("[trainer]\nstale_after_s = 0.0", "trainer.stale_after_s: 0.0 must be positive"),
        ("[trainer]\nstraggler_ratio = 0.5", "trainer.straggler_ratio: 0.5 is out of range"),
        ("[drills]\npoll_s = inf", "drills.poll_s: inf is not a finite number"),
        ("[api]\nmax_connections = 0", "api.max_connections: 0 is out of range"),
        ("[api]\nheader_timeout_s = -1.0", "api.header_timeout_s: -1.0 must be positive"),
        ("[api]\nmax_body_bytes = 1", "api.max_body_bytes: 1 is out of range"),
    ],
)
def test_nonsensical_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as caught:
        config.load(path, environ={})
    assert key in str(caught.value) and "\n" not in str(caught.value)


def test_environment_values_are_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match="rules.thermal_window_s: nan is not a finite number"):
        config.load(path, environ={"GPUWATCH_RULES_THERMAL_WINDOW_S": "nan"})


def test_every_default_passes_validation() -> None:
    config.validate(config.Config())


def test_shipped_example_listens_on_loopback_without_docs() -> None:
    loaded = config.load(EXAMPLE_CONFIG, environ={})
    assert loaded.listen_host == "127.0.0.1"
    assert loaded.api.docs is False
    assert dataclasses.asdict(loaded.api) == dataclasses.asdict(config.ApiConfig())


def test_the_unit_raises_the_fd_limit_above_the_connection_cap() -> None:
    service = parse_unit((SYSTEMD_DIR / "gpuwatch.service").read_text())["Service"]
    (limit,) = service["LimitNOFILE"]
    assert int(limit) >= config.ApiConfig().max_connections + FD_RESERVE


def one_line_error(result: object) -> str:
    output = getattr(result, "output", "")
    assert getattr(result, "exit_code", None) == 2, output
    assert "Traceback" not in output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: error: "), output
    return lines[0]


def run_args(tmp_path: Path, *extra: str) -> list[str]:
    """`gpuwatch run` refused before it binds (port 0 is not a listen address: any port will do)."""
    return [
        "run", "--backend", "sim", "--sim-gpus", "1", "--listen", "127.0.0.1:9",
        "--state-dir", str(tmp_path / "state"), "--runtime-dir", str(tmp_path / "run"), *extra,
    ]  # fmt: skip


def test_binary_config_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe" + bytes(range(256)))
    line = one_line_error(CliRunner().invoke(main, ["run", "--config", str(path)]))
    assert str(path) in line and "UTF-8" in line


def test_deeply_nested_trace_line_is_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    header = '{"format": "gpuwatch-trace", "version": 1, "static": [{"index": 0, "uuid": "GPU-0"}]}'
    trace.write_text(header + "\n" + "[" * 200_000 + "\n")
    line = one_line_error(CliRunner().invoke(main, ["replay", str(trace)]))
    assert f"{trace}:2:" in line and "nested too deeply" in line
    trace.write_text("[" * 200_000 + "\n")
    assert f"{trace}:1:" in one_line_error(CliRunner().invoke(main, ["replay", str(trace)]))


def test_token_path_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "state" / "token").mkdir(parents=True)
    line = one_line_error(CliRunner().invoke(main, run_args(tmp_path)))
    assert str(tmp_path / "state" / "token") in line


def test_token_readable_by_others_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "state" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("s3cret-token-that-others-may-have-read\n")
    token.chmod(0o644)
    line = one_line_error(CliRunner().invoke(main, run_args(tmp_path)))
    assert str(token) in line and "0644" in line
    assert token.read_text().startswith("s3cret"), "a refused token is left as it was"


@pytest.mark.slow
def test_token_created_private_and_remint_after_deletion_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpuwatch.daemon import Daemon

    cfg = sim_config(tmp_path, gpus=1)
    first = Daemon(cfg)
    first.stop()
    assert cfg.token_path.stat().st_mode & 0o777 == 0o600
    assert "API token was missing" not in caplog.text
    cfg.token_path.unlink()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.api"):
        second = Daemon(cfg)
        second.stop()
    assert second.token != first.token
    assert "API token was missing; minted a new one" in caplog.text


def test_read_only_runtime_dir_is_one_line(tmp_path: Path) -> None:
    runtime = tmp_path / "ro"
    with tmpfs(runtime, "1m", "ro") as mounted:
        if not mounted:
            if __import__("os").geteuid() == 0:
                pytest.skip("cannot mount a read-only tmpfs here, and root ignores mode bits")
            runtime.chmod(0o555)
        line = one_line_error(CliRunner().invoke(main, run_args(tmp_path, "--runtime-dir", str(runtime / "gpuwatch"))))
    assert "runtime_dir" in line and str(runtime / "gpuwatch") in line


@pytest.mark.slow
def test_cli_shows_a_refused_reason_as_one_line(tmp_path: Path) -> None:
    from gpuwatch.testing.daemon_process import DaemonProcess

    daemon = DaemonProcess(tmp_path, "--sim-gpus", "1", "--sim-scenario", "healthy").start()
    try:
        result = daemon.cli("quarantine", "0", "--reason", "two\nlines")
    finally:
        daemon.stop()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "HTTP 422: body.reason:" in line and "control character" in line
