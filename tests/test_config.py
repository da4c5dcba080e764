"""Config loading: precedence, types, and one-line errors that name where."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuwatch.config import Config, load
from gpuwatch.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(text)
    return path


def test_defaults_without_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpuwatch.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    config = load(environ={})
    assert config == Config()
    assert config.interval_s == 30.0
    assert config.listen == "127.0.0.1:9835"
    assert config.backend == "auto"


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'interval_s = 10\nbackend = "sim"\n[sim]\ngpus = 2\n')
    config = load(path, environ={"GPUWATCH_INTERVAL_S": "5", "GPUWATCH_SIM_GPUS": "3"}, overrides={"interval_s": 2.0})
    assert config.interval_s == 2.0
    assert config.sim.gpus == 3
    assert config.backend == "sim"


def test_env_list_and_bool(tmp_path: Path) -> None:
    config = load(
        write(tmp_path, ""),
        environ={"GPUWATCH_RULES_DISABLED": "power_unstable, thermal", "GPUWATCH_POLICY_QUARANTINE_ON_UNHEALTHY": "no"},
    )
    assert config.rules.disabled == ("power_unstable", "thermal")
    assert config.policy.quarantine_on_unhealthy is False


def test_drill_schedule_table_array(tmp_path: Path) -> None:
    path = write(tmp_path, '[[drills.schedule]]\ncron = "0 15 * * fri"\ndrill = "inject"\ngpu = "idle"\n')
    (entry,) = load(path, environ={}).drills.schedule
    assert entry.cron == "0 15 * * fri" and entry.drill == "inject" and entry.gpu == "idle"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("interval_s = [", "invalid TOML"),
        ("intervall_s = 5", "key intervall_s: unknown key"),
        ('[sim]\ngpus = "eight"', "key sim.gpus: expected an integer, got 'eight'"),
        ("interval_s = 0.1", "interval_s: 0.1 is out of range"),
        ('listen = "localhost"', "listen: 'localhost' is not HOST:PORT"),
        ("[policy]\nbreaker_max_share = 2.0", "policy.breaker_max_share"),
        ("sim = 3", "[sim] must be a table"),
    ],
)
def test_bad_file_names_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path, environ={})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_env_names_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="environment variable GPUWATCH_SIM_GPUS: expected an integer"):
        load(write(tmp_path, ""), environ={"GPUWATCH_SIM_GPUS": "many"})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path / "absent.toml", environ={})


def test_config_env_var_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "interval_s = 7\n")
    assert load(environ={"GPUWATCH_CONFIG": str(path)}).interval_s == 7.0


def test_an_empty_config_variable_reads_no_file_even_where_the_node_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_config = write(tmp_path, "interval_s = 7\n")
    monkeypatch.setattr("gpuwatch.config.DEFAULT_CONFIG_PATH", node_config)
    assert load(environ={}).interval_s == 7.0  # unset: the node's file
    assert load(environ={"GPUWATCH_CONFIG": ""}) == Config()  # set and empty: no file at all


def test_the_suite_never_reads_the_hosts_config() -> None:
    """conftest points GPUWATCH_CONFIG at an empty file for this process and every child that inherits it,
    so a node's /etc/gpuwatch/gpuwatch.toml (.ci/run puts a decoy there) changes no test."""
    import os

    from gpuwatch.config import DEFAULT_CONFIG_PATH, config_file
    from gpuwatch.testing.daemon_process import child_env

    used = config_file()
    assert used is not None and used != DEFAULT_CONFIG_PATH and used.read_text() == ""
    assert os.environ["GPUWATCH_CONFIG"] == str(used)
    assert load() == Config()
    assert config_file(environ=child_env()) is None


def test_slurm_and_fleet_from_file_and_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[slurm]\nenabled = true\ndrain_on = "usable_below"\nmin_usable_gpus = 6\n')
    config = load(
        path,
        environ={
            "GPUWATCH_SLURM_NODE_NAME": "gpu-017",
            "GPUWATCH_FLEET_PROMETHEUS_URL": "http://prometheus:9090",
            "GPUWATCH_FLEET_ON_UNREACHABLE": "closed",
        },
    )
    assert (config.slurm.enabled, config.slurm.drain_on, config.slurm.min_usable_gpus) == (True, "usable_below", 6)
    assert config.slurm.node_name == "gpu-017"
    assert (config.fleet.prometheus_url, config.fleet.on_unreachable) == ("http://prometheus:9090", "closed")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "GPUWATCH_SLURM_DRAIN_ON",
            "always",
            "slurm.drain_on: 'always' is not unhealthy, any_quarantine or usable_below",
        ),
        ("GPUWATCH_SLURM_NODE_NAME", "a b", "slurm.node_name: 'a b' is not a Slurm node name"),
        ("GPUWATCH_SLURM_TIMEOUT_S", "0", "slurm.timeout_s: 0.0 must be positive"),
        (
            "GPUWATCH_FLEET_PROMETHEUS_URL",
            "prometheus:9090",
            "fleet.prometheus_url: 'prometheus:9090' is not an http(s) URL",
        ),
        ("GPUWATCH_FLEET_MAX_QUARANTINED_SHARE", "1.5", "fleet.max_quarantined_share: 1.5 is not in (0, 1]"),
        ("GPUWATCH_FLEET_MAX_DRAINED_NODES", "0", "fleet.max_drained_nodes: 0 must be at least 1"),
        ("GPUWATCH_FLEET_TIMEOUT_S", "60", "fleet.timeout_s: 60.0 is out of range"),
        ("GPUWATCH_FLEET_ON_UNREACHABLE", "maybe", "fleet.on_unreachable: 'maybe' is not open or closed"),
        (
            "GPUWATCH_SLURM_MIN_USABLE_GPUS",
            "x",
            "environment variable GPUWATCH_SLURM_MIN_USABLE_GPUS: expected an integer",
        ),
    ],
)
def test_bad_slurm_and_fleet_settings_name_the_key(tmp_path: Path, variable: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load(write(tmp_path, ""), environ={variable: value})
