"""Every input outside "one line naming it, exit 2, nothing changed" found by the second hardening round.

Slurm's HealthCheckProgram reads exit 1 as "unhealthy" (drain the node) and exit 2 as "the check
itself failed", so a traceback on a bad flag is not just untidy. Each case runs the real command.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.cli import main
from gpuwatch.cluster.fleet import FleetView, judge_quarantine
from gpuwatch.config import MAX_CONFIG_BYTES, FleetConfig
from gpuwatch.node.store import QuarantineRecord, Store
from gpuwatch.testing.daemon_process import run_gpuwatch


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("value", "said"),
    [("nan", "'nan' is not a finite number"), ("inf", "'inf' is not a finite"), ("-inf", "'-inf' is not a finite"),
     ("-1", "-1.0 is not in the range")],
)  # fmt: skip
def test_check_duration_that_is_not_a_finite_time_is_one_line_exit_2(value: str, said: str) -> None:
    line = one_line(run_gpuwatch("check", "--backend", "sim", "--duration", value))
    assert line.startswith("gpuwatch check: error: Invalid value for '--duration': ") and said in line, line


def test_an_unknown_command_or_flag_is_one_line_too() -> None:
    assert one_line(run_gpuwatch("chek")) == "gpuwatch: error: No such command 'chek'. Did you mean 'check'?"
    assert one_line(run_gpuwatch("check", "--samples", "0")).startswith("gpuwatch check: error: Invalid value")
    assert one_line(run_gpuwatch("record", "--out", "x", "--duration", "nan")).endswith("'nan' is not a finite number")


def test_a_config_that_is_not_a_regular_file_is_refused_unread(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opened blocking, this would wait for a writer forever
    for path, said in (("/dev/zero", "not a regular file"), (str(fifo), "not a regular file")):
        line = one_line(run_gpuwatch("check", "--backend", "sim", "--config", path, timeout=20))
        assert line == f"gpuwatch: error: {path}: {said}: is it the right file?", line


def test_a_huge_config_is_refused_after_reading_at_most_the_limit(tmp_path: Path) -> None:
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as out:
        out.truncate(4 << 30)  # 4 GiB, sparse: read whole, it would take the memory of the node
    line = one_line(run_gpuwatch("check", "--backend", "sim", "--config", str(huge)))
    assert line == f"gpuwatch: error: {huge}: over {MAX_CONFIG_BYTES} bytes: is it the right file?"


def test_a_deeply_nested_config_is_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    line = one_line(run_gpuwatch("check", "--backend", "sim", "--config", str(deep)))
    assert line == f"gpuwatch: error: {deep}: invalid TOML: arrays or tables nested too deeply"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            '[rules]\ndisabled = ["thermal", "no_such_rule"]',
            "rules.disabled: 'no_such_rule' is not a rule id or rule module",
        ),
        ("[trainer]\nhang_idle_util_pct = 500", "trainer.hang_idle_util_pct: 500 is out of range [0, 100]"),
        ("[rules]\nlink_duty = 1.5", "rules.link_duty: 1.5 is out of range (0, 1]"),
        ("[rules]\npower_min_util_pct = -1", "rules.power_min_util_pct: -1 is out of range [0, 100]"),
        ("[trainer]\nhang_step_times = 0.0", "trainer.hang_step_times: 0.0 is out of range (0, 1e+06]"),
        ("[trainer]\nhang_after_s = 1e300", "trainer.hang_after_s: 1e+300 is over ten years"),
        ("[rules]\npcie_errors_per_hour = -5.0", "rules.pcie_errors_per_hour: -5.0 is out of range"),
        ('listen = "127.0.0.1:0"', "listen: '127.0.0.1:0' is not HOST:PORT (a port from 1 to 65535)"),
        ('[trainer]\nstop_signal = "SIGKILL"', "trainer.stop_signal: SIGKILL cannot be caught"),
        ('[trainer]\nstop_signal = "STOP"', "trainer.stop_signal: SIGSTOP cannot be caught"),
        ('[trainer]\nstop_signal = "9"', "trainer.stop_signal: SIGKILL cannot be caught"),
        ('[trainer]\nstop_signal = "SIGNOPE"', "trainer.stop_signal: 'SIGNOPE' is not a signal"),
        ('[fleet]\nprometheus_url = "http://p:9090"\nmax_quarantined_share = nan', "fleet.max_quarantined_share: nan"),
    ],
)
def test_a_bad_value_names_the_key_and_the_file_and_changes_nothing(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(text + "\n")
    state = tmp_path / "state"
    result = CliRunner().invoke(main, ["check", "--backend", "sim", "--samples", "1", "--config", str(path),
                                       "--state-dir", str(state)])  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"gpuwatch: error: {said}") and line.endswith(f"(in {path})"), line
    assert not state.exists(), "nothing was created"


def test_a_bad_value_from_a_variable_or_a_flag_names_that_instead(tmp_path: Path) -> None:
    env = {"GPUWATCH_TRAINER_HANG_IDLE_UTIL_PCT": "500"}
    line = one_line(run_gpuwatch("status", env=env))
    assert line.endswith("(from environment variable GPUWATCH_TRAINER_HANG_IDLE_UTIL_PCT)"), line
    line = one_line(run_gpuwatch("status", "--listen", "localhost:0"))
    assert (
        line
        == "gpuwatch: error: listen: 'localhost:0' is not HOST:PORT (a port from 1 to 65535) (from option --listen)"
    )


def test_rule_modules_and_rule_ids_may_still_be_disabled(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text('[rules]\ndisabled = ["ecc", "sm_clock_low_unexplained", "clocks_hw_slowdown"]\n')
    result = run_gpuwatch("check", "--backend", "sim", "--sim-scenario", "demo", "--json", "--config", str(path))
    assert "gpuwatch: error" not in result.stderr, result.stderr
    rules = {f["rule"] for g in json.loads(result.stdout)["gpus"] for f in g["findings"]}
    assert not rules & {"ecc_uncorrectable", "sm_clock_low_unexplained", "clocks_hw_slowdown"}, rules


def test_a_nan_fleet_limit_that_escaped_validation_still_fails_closed() -> None:
    """Config() is built unchecked in code; every comparison with nan is false, which used to allow."""
    unchecked = FleetConfig(prometheus_url="http://p", max_quarantined_share=float("nan"))
    assert judge_quarantine(FleetView(0.0, 0), unchecked) is not None


DB_FILES = ("gpuwatch.db", "gpuwatch.db-wal", "gpuwatch.db-shm")


def test_the_database_is_created_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = Store(tmp_path / "gpuwatch.db")
        store.set_quarantine(QuarantineRecord("GPU-x", 0, "written, so the WAL exists", 1.0, False, False, 1))
        modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in DB_FILES}
    finally:
        os.umask(old)
    store.close()
    assert modes == dict.fromkeys(DB_FILES, 0o600)


def test_a_database_found_world_readable_is_made_private(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gpuwatch.db"
    Store(path).close()
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="gpuwatch.store"):
        Store(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [r.getMessage() for r in caplog.records] == [f"{path} was mode 0644: made it 0600 (quarantines, incidents)"]
