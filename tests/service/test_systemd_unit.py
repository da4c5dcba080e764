"""systemd/gpuwatch.service: systemd itself accepts it, and it holds the directives gpuwatch relies on."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from gpuwatch import config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD_DIR / "gpuwatch.service"
SOCKET_UNIT = SYSTEMD_DIR / "gpuwatch.socket"
DROP_IN = SYSTEMD_DIR / "pcie-drill.conf"
EXAMPLE_CONFIG = SYSTEMD_DIR / "gpuwatch.toml"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Section → key → values in order (systemd keys may repeat, e.g. DeviceAllow=)."""
    unit: Unit = defaultdict(lambda: defaultdict(list))
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        unit[section][key.strip()].append(value.strip())
    return unit


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key, [])
    assert len(values) == 1, f"{key}= should be set exactly once, found {values}"
    return values[0]


def _systemd_analyze() -> str:
    """systemd-analyze's path; the test is skipped where it is not installed."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return analyze


def _unit_with_stand_in(tmp_path: Path) -> str:
    """The unit's text with ExecStart pointed at a stand-in that exists (verify needs the binary)."""
    fake = tmp_path / "bin" / "gpuwatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    text = UNIT.read_text()
    assert "ExecStart=/opt/gpuwatch/bin/gpuwatch " in text
    return text.replace("ExecStart=/opt/gpuwatch/bin/gpuwatch ", f"ExecStart={fake} ")


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    """`systemd-analyze verify` prints nothing about the unit or its drop-in.

    It needs ExecStart's binary to exist, so the copy points at a stand-in. It needs no running
    systemd; it may still complain about units of the host, so only lines naming ours count.
    """
    analyze = _systemd_analyze()
    unit = tmp_path / "gpuwatch.service"
    unit.write_text(_unit_with_stand_in(tmp_path))
    drop_in_dir = tmp_path / "gpuwatch.service.d"
    drop_in_dir.mkdir()
    shutil.copy(DROP_IN, drop_in_dir / DROP_IN.name)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if "gpuwatch" in line]
    assert ours == [], f"systemd-analyze verify complained:\n{output}"


def test_verify_would_catch_a_bad_directive(tmp_path: Path) -> None:
    """The check above is not vacuous: a typo in our unit shows up in the output."""
    analyze = _systemd_analyze()
    unit = tmp_path / "gpuwatch.service"
    unit.write_text(UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystem=stirct"))
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "gpuwatch.service" in proc.stdout + proc.stderr


def test_systemd_analyze_verify_is_clean_for_the_socket_and_the_service(tmp_path: Path) -> None:
    """The pair as installed: the socket unit starts the service on its sockets; verify says nothing of either."""
    analyze = _systemd_analyze()
    (tmp_path / "gpuwatch.service").write_text(_unit_with_stand_in(tmp_path))
    shutil.copy(SOCKET_UNIT, tmp_path / SOCKET_UNIT.name)
    for broken in ("", "ListenStream=/var", "SocketMode=0666"):  # as shipped, then two typos that verify must catch
        text = SOCKET_UNIT.read_text()
        if broken:
            text = text.replace(broken, broken.replace("=", "X=", 1))
        (tmp_path / SOCKET_UNIT.name).write_text(text)
        units = [str(tmp_path / "gpuwatch.socket"), str(tmp_path / "gpuwatch.service")]
        proc = subprocess.run([analyze, "verify", "--man=no", *units], capture_output=True, text=True, timeout=60)
        ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "gpuwatch" in line]
        assert (ours == []) == (broken == ""), f"{broken or 'as shipped'}: {ours}"


def test_the_socket_unit_holds_what_the_config_and_the_unit_say() -> None:
    """ListenStream= must be `listen` and api.socket as the shipped unit and example config make them: the
    daemon refuses to start on sockets its config does not name."""
    sockets = parse_unit(SOCKET_UNIT.read_text())
    service = parse_unit(UNIT.read_text())
    env = dict(item.split("=", 1) for value in service["Service"]["Environment"] for item in value.split())
    loaded = config.load(EXAMPLE_CONFIG, environ=env)
    assert sockets["Socket"]["ListenStream"] == [loaded.listen, str(loaded.control_socket)]
    assert sockets["Socket"]["SocketMode"] == ["0666"], "any user's `gpuwatch launch` reads the GPU list over it"
    assert sockets["Install"]["WantedBy"] == ["sockets.target"]
    assert "gpuwatch.socket" in service["Unit"]["Wants"] and "gpuwatch.socket" in service["Unit"]["After"]


def test_lifecycle_directives(service: dict[str, list[str]]) -> None:
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    assert one(service, "Restart") == "on-failure"
    assert one(service, "RestartSec") == "5"
    assert one(service, "TimeoutStartSec") == "120"
    assert one(service, "KillMode") == "mixed"
    assert one(service, "TimeoutStopSec")


def test_exit_2_is_not_restarted_and_other_failures_stop_after_a_limit() -> None:
    """Exit 2 (no GPU, a bad config) cannot heal by itself: systemd must not restart it every RestartSec forever.

    Other failures are restarted, but at most StartLimitBurst times in StartLimitIntervalSec, which must be long
    enough to hold that many restarts RestartSec apart (systemd's default, 5 in 10 s, never trips at 5 s apart).
    """
    unit = parse_unit(UNIT.read_text())
    service = unit["Service"]
    assert one(service, "RestartPreventExitStatus").split() == ["2"]
    assert one(service, "Restart") == "on-failure"
    burst = int(one(unit["Unit"], "StartLimitBurst"))
    interval = float(one(unit["Unit"], "StartLimitIntervalSec"))
    assert 1 <= burst and interval > burst * float(one(service, "RestartSec"))


def test_a_daemon_that_cannot_start_exits_2(tmp_path: Path) -> None:
    """What RestartPreventExitStatus=2 relies on: no GPU and a bad config both end `gpuwatch run` with exit 2."""
    from gpuwatch.testing.daemon_process import run_gpuwatch

    bad = tmp_path / "bad.toml"
    bad.write_text("interval_s = -1\n")
    no_gpu = run_gpuwatch("run", "--backend", "nvml", "--state-dir", str(tmp_path / "s"), env={"LD_LIBRARY_PATH": ""})
    bad_config = run_gpuwatch("run", "--config", str(bad))
    assert (no_gpu.returncode, bad_config.returncode) == (2, 2), no_gpu.stderr + bad_config.stderr
    assert "interval_s" in bad_config.stderr


@pytest.mark.parametrize("directive", ["RestartPreventExitStatus=2", "StartLimitIntervalSec=600", "StartLimitBurst=5"])
def test_verify_checks_the_restart_directives(tmp_path: Path, directive: str) -> None:
    """systemd-analyze parses the directives that stop the flapping: a bad value in one is reported on its line."""
    analyze = _systemd_analyze()
    text = UNIT.read_text()
    assert directive in text
    line = text[: text.index(directive)].count("\n") + 1
    unit = tmp_path / "gpuwatch.service"
    unit.write_text(text.replace(directive, directive.split("=")[0] + "=bogus"))
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert f"gpuwatch.service:{line}: Failed to parse" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_watchdog_allows_three_default_ticks(service: dict[str, list[str]]) -> None:
    """The daemon pings once per sampling tick; one late tick must not get it killed."""
    assert float(one(service, "WatchdogSec")) >= 3 * config.Config().interval_s


def test_exec_start_uses_the_default_config_path(service: dict[str, list[str]]) -> None:
    argv = one(service, "ExecStart").split()
    assert argv[:2] == ["/opt/gpuwatch/bin/gpuwatch", "run"]  # the venv systemd/README.md makes
    assert argv[argv.index("--config") + 1] == str(config.DEFAULT_CONFIG_PATH)


def test_directories_match_the_environment(service: dict[str, list[str]]) -> None:
    """systemd creates and unlocks /var/lib/gpuwatch and /run/gpuwatch; the daemon is pinned to them."""
    assert one(service, "StateDirectory") == "gpuwatch"
    assert one(service, "RuntimeDirectory") == "gpuwatch"
    assert one(service, "RuntimeDirectoryPreserve") == "yes"
    assert one(service, "RuntimeDirectoryMode") == "0755"
    assert one(service, "ConfigurationDirectory") == "gpuwatch"
    assert one(service, "CacheDirectory") == "gpuwatch"
    env = dict(item.split("=", 1) for value in service["Environment"] for item in value.split())
    assert env == {
        "GPUWATCH_STATE_DIR": "/var/lib/gpuwatch",
        "GPUWATCH_RUNTIME_DIR": "/run/gpuwatch",
        "HOME": "/var/cache/gpuwatch",  # ProtectHome hides /root; drill tools cache under $HOME
    }
    loaded = config.load(environ=env, path=EXAMPLE_CONFIG)
    assert (loaded.state_dir, loaded.runtime_dir) == ("/var/lib/gpuwatch", "/run/gpuwatch")
    assert one(service, "EnvironmentFile") == "-/etc/default/gpuwatch"


def test_sandbox_keeps_the_gpus_reachable(service: dict[str, list[str]]) -> None:
    assert one(service, "ProtectSystem") == "strict"
    assert one(service, "NoNewPrivileges") == "yes"
    assert one(service, "PrivateTmp") == "yes"
    assert one(service, "ProtectHome") == "yes"
    assert one(service, "ProtectKernelModules") == "yes"
    assert one(service, "ProtectControlGroups") == "yes"
    assert one(service, "RestrictSUIDSGID") == "yes"
    assert one(service, "LockPersonality") == "yes"
    assert one(service, "RestrictRealtime") == "yes"
    assert one(service, "SystemCallArchitectures") == "native"
    assert service.get("PrivateDevices", ["no"]) == ["no"], "PrivateDevices=yes hides /dev/nvidia*"
    assert service.get("ProtectKernelLogs", ["no"]) == ["no"], "the drill verifier reads NVRM Xid lines"
    assert "User" not in service, "runs as root to signal other users' trainer ranks"
    assert one(service, "DevicePolicy") in {"auto", "closed"}
    assert "char-nvidia* rw" in service["DeviceAllow"]
    memory_max = one(service, "MemoryMax")
    assert memory_max.endswith("G") and float(memory_max[:-1]) >= 1, "a drill's torch process peaks at 760 MB"
    assert one(service, "CPUQuota")


def test_pcie_drill_drop_in_only_unlocks_sysfs() -> None:
    drop_in = parse_unit(DROP_IN.read_text())
    assert {section: dict(keys) for section, keys in drop_in.items()} == {"Service": {"ProtectKernelTunables": ["no"]}}


def test_example_config_loads() -> None:
    loaded = config.load(EXAMPLE_CONFIG, environ={})
    assert loaded.listen_port == config.DEFAULT_PORT
    assert loaded.backend != "sim"


def example_entries() -> list[tuple[str, str, str, bool]]:
    """(section, key, value, commented) for every assignment in the example config ('' is the top level)."""
    entries = []
    section = ""
    for line in EXAMPLE_CONFIG.read_text().splitlines():
        commented = line.startswith("#")
        text = line.lstrip("# ").strip()
        header = re.fullmatch(r"\[\[?([\w.]+)\]\]?", text)
        if header:
            section = header.group(1)
            continue
        assignment = re.fullmatch(r"(\w+) = (.+)", text)
        if assignment:
            entries.append((section, assignment.group(1), assignment.group(2), commented))
    return entries


def test_example_config_names_every_option_with_its_default() -> None:
    defaults = config.Config()
    sections = config.sections()
    owners: dict[str, Any] = {"": defaults, **{name: getattr(defaults, name) for name in sections}}
    owners["drills.schedule"] = config.DrillSchedule(cron="", drill="")
    named: dict[str, set[str]] = defaultdict(set)
    for section, key, value, commented in example_entries():
        named[section].add(key)
        if commented and section != "drills.schedule":
            parsed = tomllib.loads(f"v = {value}")["v"]
            assert (tuple(parsed) if isinstance(parsed, list) else parsed) == getattr(owners[section], key), key
    for section, owner in owners.items():
        expected = {f.name for f in dataclasses.fields(owner)} - set(sections) - {"schedule"}
        assert named[section] == expected, section
