"""The node install of systemd/README.md, followed as written under a scratch root, used from there, and undone.

One wheel build and one venv per session: the README's install lines run under a temp dir that stands for `/`
(apt-get left out: host-wide), `gpuwatch service install --now` with `--root` pointing there (systemd is not
PID 1 here, so the unit is enabled offline and not started). Then: the files it put in place, the unit
verified by `systemd-analyze verify --root` against the install, the daemon started as the unit starts it
(its ExecStart=, Environment= and EnvironmentFile=) answering /healthz and found by the CLI through the config
file, the commands of the installed venv outside the checkout, and `service uninstall` leaving the root as it
was before `service install`.
"""

from __future__ import annotations

import hashlib
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
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import free_port
from tests.service.test_systemd_unit import parse_unit

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "systemd" / "README.md"
HOST_ONLY = ("apt-get ",)  # root-wide packages of the host
STOCK_UNITS = Path("/usr/lib/systemd/system")  # sysinit.target and friends, which the unit is ordered against


def install_lines() -> list[str]:
    """The shell lines of the README's install block, in order."""
    block = README.read_text().split("<!-- install steps")[1].split("<!-- end of install steps -->")[0]
    code = block.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in code.splitlines() if line.strip()]


def wheel_command() -> str:
    """The one command the docs give for building the wheel in a clone (into dist/, not the checkout's root)."""
    block = README.read_text().split("<!-- wheel:")[1].split("```sh\n", 1)[1].split("```", 1)[0]
    (line,) = [line for line in block.splitlines() if line.strip()]
    assert f"`{line}`" in (ROOT / "README.md").read_text()  # the README gives the same one
    return line


def under(prefix: Path, text: str) -> str:
    """`text` with every absolute path into /opt, /etc, /usr, /var or /run moved under `prefix`."""
    return re.sub(r"(?<![\w./*-])/(opt|etc|usr|var|run)/", lambda m: f"{prefix}/{m.group(1)}/", text)


def tree(root: Path, skip: Path) -> dict[str, str]:
    """Every path under `root` but `skip` (the venv, where Python writes bytecode as it runs): type, mode, content."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path == skip or skip in path.parents:
            continue
        what = path.lstat()
        if path.is_symlink():
            kind = f"link {os.readlink(path)}"
        elif path.is_dir():
            kind = "dir"
        else:
            kind = hashlib.sha256(path.read_bytes()).hexdigest()
        found[str(path.relative_to(root))] = f"{oct(what.st_mode)} {kind}"
    return found


@dataclass
class Node:
    prefix: Path
    env: dict[str, str]
    before: dict[str, str]  # the root before `service install`
    installed: str  # what `service install --now` printed
    wheel: Path

    @property
    def venv(self) -> Path:
        return self.prefix / "opt" / "gpuwatch"

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def gpuwatch(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.prefix / "usr" / "local" / "bin" / "gpuwatch"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.prefix,
        )


def node_config(shipped: str, prefix: Path, port: int) -> str:
    """The example config edited as the README tells an operator of a node that is not an 8-GPU NVML node:
    here the sim with two idle GPUs, a free loopback port, and the scratch root's state and runtime dirs."""
    text = shipped
    for old, new in (
        ('backend = "nvml"', 'backend = "sim"'),
        ("expected_gpus = 8", "expected_gpus = 2"),
        ("# interval_s = 30.0", "interval_s = 1.0"),
        ('# listen = "127.0.0.1:9835"', f'listen = "localhost:{port}"'),
        ('# state_dir = "/var/lib/gpuwatch"', f'state_dir = "{prefix}/var/lib/gpuwatch"'),
        ('# runtime_dir = "/run/gpuwatch"', f'runtime_dir = "{prefix}/run/gpuwatch"'),
        ("# gpus = 8", "gpus = 2"),
        ('# scenario = "demo"', 'scenario = "idle"'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Node:
    if shutil.which("systemctl") is None:
        pytest.skip("systemctl is not installed (Debian: apt-get install systemd)")
    prefix = tmp_path_factory.mktemp("root")
    wheels = tmp_path_factory.mktemp("wheels")
    documented = wheel_command().split()  # python3 -m pip wheel --no-deps -w dist .
    assert documented[-3:] == ["-w", "dist", "."], documented
    build = [sys.executable, *documented[1:-3], "-q", "--no-build-isolation", "-w", str(wheels)]  # offline here
    subprocess.run([*build, str(ROOT)], check=True, capture_output=True, timeout=300)
    if STOCK_UNITS.is_dir():
        shutil.copytree(STOCK_UNITS, prefix / STOCK_UNITS.relative_to("/"), symlinks=True)
    # Outside the checkout nothing may lead back to it: no PYTHONPATH, no variables of a dev shell.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("GPUWATCH_", "VIRTUAL_ENV"))}
    env["GPUWATCH_CONFIG"] = ""  # the host's own /etc/gpuwatch/gpuwatch.toml is not this root's
    *steps, service_install = install_lines()
    assert service_install == "/opt/gpuwatch/bin/gpuwatch service install --now"
    for line in steps:
        if line.startswith(HOST_ONLY):
            continue
        done = subprocess.run(
            ["bash", "-euc", under(prefix, line)], cwd=wheels, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
    # Not an 8-GPU NVML node: its config settled before the service starts (install keeps a config in place).
    shipped = (prefix / "opt/gpuwatch/share/gpuwatch/gpuwatch.toml").read_text()
    config = prefix / "etc" / "gpuwatch" / "gpuwatch.toml"
    config.parent.mkdir(parents=True)
    config.write_text(node_config(shipped, prefix, free_port()))
    for directory in ("var/lib", "var/cache", "run"):  # on any real root
        (prefix / directory).mkdir(parents=True, exist_ok=True)
    before = tree(prefix, prefix / "opt" / "gpuwatch")
    done = subprocess.run(
        [*under(prefix, service_install).split(), "--root", str(prefix)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = wheels.glob("gpuwatch_daemon-*.whl")
    return Node(prefix, env, before, done.stdout, wheel)


def test_service_install_puts_the_node_files_in_place(node: Node) -> None:
    unit_path = node.prefix / "etc/systemd/system/gpuwatch.service"
    unit = parse_unit(unit_path.read_text())
    assert unit["Service"]["ExecStart"] == ["/opt/gpuwatch/bin/gpuwatch run --config /etc/gpuwatch/gpuwatch.toml"]
    assert unit["Unit"]["Documentation"] == ["file:/opt/gpuwatch/share/gpuwatch/README.md"]
    assert (node.venv / "share/gpuwatch/README.md").is_file()  # the link names a file that exists
    assert (unit_path.stat().st_mode & 0o777) == 0o644
    wants = node.prefix / "etc/systemd/system/multi-user.target.wants/gpuwatch.service"
    assert os.readlink(wants) == "/etc/systemd/system/gpuwatch.service"  # enabled, offline
    link = node.prefix / "usr/local/bin/gpuwatch"
    assert link.is_symlink() and link.resolve() == node.bin / "gpuwatch"
    assert not (node.prefix / "etc/systemd/system/gpuwatch.service.d").exists()  # the pcie drill's: opt-in
    assert "kept /etc/gpuwatch/gpuwatch.toml as it is" in node.installed
    assert "verified gpuwatch.socket, gpuwatch.service with systemd-analyze" in node.installed
    assert "enabled gpuwatch.socket, gpuwatch.service; not started in that root" in node.installed
    manifest = json.loads((node.venv / "share/gpuwatch/installed.json").read_text())
    assert [f["target"] for f in manifest["files"]] == [
        "/etc/systemd/system/gpuwatch.socket",
        "/etc/systemd/system/gpuwatch.service",
    ]
    assert manifest["enabled"] == ["gpuwatch.socket", "gpuwatch.service"]
    assert manifest["link"] == "/usr/local/bin/gpuwatch"
    socket_wants = node.prefix / "etc/systemd/system/sockets.target.wants/gpuwatch.socket"
    assert os.readlink(socket_wants) == "/etc/systemd/system/gpuwatch.socket"  # the port is held from boot


def test_the_package_index_page_is_the_readme(node: Node) -> None:
    """PyPI shows the wheel's long description: README.md as it is, short enough to read."""
    with zipfile.ZipFile(node.wheel) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = wheel.read(name).decode()
    headers, body = metadata.split("\n\n", 1)
    assert "Description-Content-Type: text/markdown" in headers
    assert body.strip() == (ROOT / "README.md").read_text().strip()
    assert len(metadata) < 20_000, len(metadata)


def test_the_command_runs_the_installed_wheel(node: Node) -> None:
    probe = "import gpuwatch, importlib.metadata as m; print(gpuwatch.__file__, m.version('gpuwatch-daemon'))"
    done = subprocess.run(
        [str(node.bin / "python"), "-c", probe], capture_output=True, text=True, env=node.env, cwd=node.prefix
    )
    where, version = done.stdout.split()
    assert Path(where).is_relative_to(node.venv), where
    assert version


def test_the_wheel_ships_the_monitoring_assets(node: Node, tmp_path: Path) -> None:
    out = tmp_path / "prometheus-host"
    done = node.gpuwatch("service", "assets", "--out", str(out))
    assert done.returncode == 0, done.stderr
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == [
        "RUNBOOK.md",
        "alertmanager/alertmanager.yml",
        "grafana/gpuwatch.json",
        "prometheus/gpuwatch-alerts.yml",
        "prometheus/gpuwatch-recording.yml",
        "prometheus/prometheus.yml",
    ]
    links = re.findall(r"runbook_url: (\S+)", (out / "prometheus/gpuwatch-alerts.yml").read_text())
    assert len(links) > 20 and all(link.startswith(f"file://{out}/RUNBOOK.md#runbook-") for link in links)
    headings = re.findall(r"^### Runbook: (\w+)", (out / "RUNBOOK.md").read_text(), re.MULTILINE)
    anchors = {f"runbook-{name.lower()}" for name in headings}
    assert {link.split("#")[1] for link in links} <= anchors  # each opens a heading of the copied runbook
    assert f'"url": "file://{out}/RUNBOOK.md#runbook"' in (out / "grafana/gpuwatch.json").read_text()
    published = node.gpuwatch("service", "assets", "--out", str(out), "--runbook-url", "https://wiki.example/rb.md")
    assert published.returncode == 0
    assert '"url": "https://wiki.example/rb.md#runbook"' in (out / "grafana/gpuwatch.json").read_text()
    assert "runbook_url: https://wiki.example/rb.md#runbook-" in (out / "prometheus/gpuwatch-alerts.yml").read_text()
    bad = node.gpuwatch("service", "assets", "--out", str(out), "--runbook-url", "wiki/rb.md")
    assert bad.returncode == 2 and bad.stderr.startswith("gpuwatch service: error: --runbook-url 'wiki/rb.md': ")


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


def test_launch_without_torch_names_the_python_and_the_fix(node: Node) -> None:
    """The node's venv has no torch: launch says which Python lacks it and that the job's environment needs us."""
    done = node.gpuwatch("launch", "--", "train.py")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"torch is not installed in {node.bin / 'python'}" in done.stderr
    assert "install gpuwatch-daemon into the job's own environment" in done.stderr


def test_the_installed_unit_verifies_against_the_install(node: Node) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
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
    """The daemon as systemd would start it: the unit's ExecStart=, Environment= and EnvironmentFile=, under the
    scratch root; the directories systemd would make for it (StateDirectory= and friends) made here."""
    config = node.prefix / "etc" / "gpuwatch" / "gpuwatch.toml"
    for directory in ("var/lib/gpuwatch", "run/gpuwatch", "var/cache/gpuwatch"):
        (node.prefix / directory).mkdir(parents=True, exist_ok=True)
    service = parse_unit((node.prefix / "etc" / "systemd" / "system" / "gpuwatch.service").read_text())["Service"]
    (exec_start,) = service["ExecStart"]
    argv = under(node.prefix, exec_start).split()
    env = dict(node.env)
    for value in service["Environment"]:
        env.update(item.split("=", 1) for item in under(node.prefix, value).split())
    (environment_file,) = service["EnvironmentFile"]
    assert environment_file == "-/etc/default/gpuwatch" and not (node.prefix / "etc/default/gpuwatch").exists()
    log = (node.prefix / "daemon.log").open("w")
    process = subprocess.Popen(argv, env=env, cwd="/", stdout=log, stderr=subprocess.STDOUT, text=True)
    listen = re.search(r'listen = "(.+)"', config.read_text())
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
    (node.prefix / "daemon.log").unlink(missing_ok=True)


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
    assert Path(program).is_relative_to(node.venv) and Path(program).is_file()
    assert "dry run: nothing was done; add --yes to do it" in done.stdout


def test_a_second_daemon_on_the_same_state_dir_exits_2_naming_the_first(node: Node, unit_daemon: tuple) -> None:
    first, argv, env, _ = unit_daemon
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"another gpuwatch daemon (pid {first.pid}) already runs on state dir" in line
    assert first.poll() is None


def test_zz_uninstall_leaves_the_root_as_it_was(node: Node, unit_daemon: tuple) -> None:
    """Last (zz): `service uninstall --purge` after the daemon ran undoes install and what systemd would have
    made; the operator's own config, there before install, stays."""
    first, _, _, _ = unit_daemon
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0
    done = node.gpuwatch("service", "uninstall", "--purge", "--root", str(node.prefix))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "disabled gpuwatch.service" in done.stdout and "removed /etc/systemd/system/gpuwatch.service" in done.stdout
    (node.prefix / "daemon.log").unlink(missing_ok=True)
    assert tree(node.prefix, node.venv) == node.before
    assert not (node.venv / "share/gpuwatch/installed.json").exists()
