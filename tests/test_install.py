"""The node install of systemd/README.md, followed as written under a scratch root, and used from there.

One wheel build and one venv per session: the README's install lines run under a temp dir that
stands for `/` (apt-get and systemctl left out: host-wide, and no systemd runs here). Then, from
the installed venv and outside the checkout: `gpuwatch check` on the sim, `drill --list`, `bench`
without torch, the unit verified by `systemd-analyze verify --root` against the install, and the
daemon started as the unit starts it, answering /healthz, found by the CLI through the config file,
refusing a second copy, and finding the XID drill's program inside the install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.bench.daemon_process import free_port
from tests.test_systemd_unit import parse_unit

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "systemd" / "README.md"
HOST_ONLY = ("apt-get ", "systemctl ")  # need the real host: root-wide packages, a running systemd


def install_lines() -> list[str]:
    """The shell lines of the README's install block, in order."""
    block = README.read_text().split("<!-- install steps")[1].split("<!-- end of install steps -->")[0]
    code = block.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in code.splitlines() if line.strip()]


def under(prefix: Path, text: str) -> str:
    """`text` with every absolute path into /opt, /etc, /usr, /var or /run moved under `prefix`."""
    return re.sub(r"(?<![\w./*-])/(opt|etc|usr|var|run)/", lambda m: f"{prefix}/{m.group(1)}/", text)


@dataclass
class Node:
    prefix: Path
    env: dict[str, str]

    @property
    def bin(self) -> Path:
        return self.prefix / "opt" / "gpuwatch" / "bin"

    def gpuwatch(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.prefix / "usr" / "local" / "bin" / "gpuwatch"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.prefix,
        )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    prefix = tmp_path_factory.mktemp("root")
    wheels = tmp_path_factory.mktemp("wheels")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    subprocess.run([*build, str(ROOT)], check=True, capture_output=True, timeout=300)
    # Outside the checkout nothing may lead back to it: no PYTHONPATH, no variables of a dev shell.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("GPUWATCH_", "VIRTUAL_ENV"))}
    env["GPUWATCH_CONFIG"] = ""  # the host's own /etc/gpuwatch/gpuwatch.toml is not this root's
    for line in install_lines():
        if line.startswith(HOST_ONLY):
            continue
        done = subprocess.run(
            ["bash", "-euc", under(prefix, line)], cwd=wheels, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
    return Node(prefix, env)


def test_the_command_runs_the_installed_wheel(node: Node) -> None:
    probe = "import gpuwatch, importlib.metadata as m; print(gpuwatch.__file__, m.version('gpuwatch-daemon'))"
    done = subprocess.run(
        [str(node.bin / "python"), "-c", probe], capture_output=True, text=True, env=node.env, cwd=node.prefix
    )
    where, version = done.stdout.split()
    assert Path(where).is_relative_to(node.prefix / "opt" / "gpuwatch"), where
    assert (node.prefix / "usr" / "local" / "bin" / "gpuwatch").resolve() == node.bin / "gpuwatch"
    assert version


def test_check_on_the_sim_flags_the_demo_faults(node: Node) -> None:
    done = node.gpuwatch("check", "--backend", "sim")
    assert done.returncode == 1, done.stdout + done.stderr
    flagged = {line.split()[1]: line for line in done.stdout.splitlines() if not line.endswith("no findings")}
    assert set(flagged) == {"3", "5"}, done.stdout
    assert "clocks_hw_slowdown" in flagged["3"] and "ecc_uncorrectable" in flagged["5"]


def test_drill_list_needs_no_daemon(node: Node) -> None:
    done = node.gpuwatch("drill", "--list")
    assert done.returncode == 0, done.stderr
    assert {"inject", "xid_fault", "kill_rank", "reset_gpu", "pcie_remove"} <= {
        line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")
    }


def test_bench_skips_what_needs_torch_with_a_note(node: Node, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--backend", "sim", "--gpus", "2", "--quick", "--only", "remediation", "--json", str(out)]
    done = node.gpuwatch("bench", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    section = json.loads(out.read_text())["sections"]["remediation"]
    assert section["status"] == "skipped" and "needs torch" in section["reason"], section


def test_the_installed_unit_verifies_against_the_install(node: Node) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    units = Path("/usr/lib/systemd/system")
    if units.is_dir():  # the stock targets (sysinit.target, ...) the unit is ordered against
        shutil.copytree(units, node.prefix / "usr" / "lib" / "systemd" / "system", dirs_exist_ok=True)
    unit = node.prefix / "etc" / "systemd" / "system" / "gpuwatch.service"
    verify = [analyze, "verify", "--man=no", f"--root={node.prefix}", str(unit)]

    def complaints() -> list[str]:
        done = subprocess.run(verify, capture_output=True, text=True, timeout=60, env=node.env)
        return [line for line in (done.stdout + done.stderr).splitlines() if "gpuwatch" in line]

    assert complaints() == []
    # Not vacuous: ExecStart= is looked up inside the root, so a missing venv is reported.
    script = node.bin / "gpuwatch"
    script.rename(script.with_name("moved"))
    try:
        assert any("/opt/gpuwatch/bin/gpuwatch" in line for line in complaints())
    finally:
        script.with_name("moved").rename(script)


@pytest.fixture(scope="module")
def unit_daemon(node: Node) -> Iterator[tuple[subprocess.Popen[str], list[str], dict[str, str], Path]]:
    """The daemon as systemd would start it: the unit's ExecStart= and Environment=, under the scratch root.

    The config is edited as the README tells an operator to (here: the sim, two idle GPUs, a free
    loopback port, and the scratch root's state and runtime dirs); systemd would make those dirs.
    """
    config = node.prefix / "etc" / "gpuwatch" / "gpuwatch.toml"
    state, runtime = node.prefix / "var" / "lib" / "gpuwatch", node.prefix / "run" / "gpuwatch"
    text = config.read_text()
    for old, new in (
        ('backend = "nvml"', 'backend = "sim"'),
        ("expected_gpus = 8", "expected_gpus = 2"),
        ("# interval_s = 30.0", "interval_s = 1.0"),
        ('# listen = "127.0.0.1:9835"', f'listen = "localhost:{free_port()}"'),
        ('# state_dir = "/var/lib/gpuwatch"', f'state_dir = "{state}"'),
        ('# runtime_dir = "/run/gpuwatch"', f'runtime_dir = "{runtime}"'),
        ("# gpus = 8", "gpus = 2"),
        ('# scenario = "demo"', 'scenario = "idle"'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    config.write_text(text)
    for directory in (state, runtime, node.prefix / "var" / "cache" / "gpuwatch"):
        directory.mkdir(parents=True, exist_ok=True)
    service = parse_unit((node.prefix / "etc" / "systemd" / "system" / "gpuwatch.service").read_text())["Service"]
    (exec_start,) = service["ExecStart"]
    argv = under(node.prefix, exec_start).split()
    env = dict(node.env)
    for value in service["Environment"]:
        env.update(item.split("=", 1) for item in under(node.prefix, value).split())
    log = (node.prefix / "daemon.log").open("w")
    process = subprocess.Popen(argv, env=env, cwd="/", stdout=log, stderr=subprocess.STDOUT, text=True)
    listen = re.search(r'listen = "(.+)"', text)
    assert listen is not None
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://{listen.group(1)}/healthz", timeout=2) as resp:
                assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
            break
        except (OSError, urllib.error.HTTPError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail((node.prefix / "daemon.log").read_text())
            time.sleep(0.2)
    yield process, argv, env, config
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    log.close()


def test_the_cli_finds_the_daemon_through_the_config_file(node: Node, unit_daemon: tuple) -> None:
    _, _, _, config = unit_daemon
    done = node.gpuwatch("status", "--config", str(config), "--plain")
    assert done.returncode == 0, done.stderr
    assert [line.split(",")[0] for line in done.stdout.splitlines()] == ["GPU 0", "GPU 1"]
    assert all("state: healthy" in line for line in done.stdout.splitlines())


def test_the_xid_drill_finds_its_program_in_the_install(node: Node, unit_daemon: tuple) -> None:
    _, _, _, config = unit_daemon
    done = node.gpuwatch("drill", "--xid-fault", "0", "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    (program,) = re.findall(r"run (\S+/xid_fault\.py) --gpu 0 --yes", done.stdout)
    assert Path(program).is_relative_to(node.prefix / "opt" / "gpuwatch") and Path(program).is_file()
    assert "dry run: nothing was done; add --yes to do it" in done.stdout


def test_a_second_daemon_on_the_same_state_dir_exits_2_naming_the_first(node: Node, unit_daemon: tuple) -> None:
    first, argv, env, _ = unit_daemon
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"another gpuwatch daemon (pid {first.pid}) already runs on state dir" in line
    assert first.poll() is None
