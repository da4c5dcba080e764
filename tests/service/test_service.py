"""`gpuwatch service install | uninstall` on a scratch root: what goes where, what is kept, and uninstall undoing
exactly what install did. The venv is a stand-in (the shipped files copied from the checkout, a gpuwatch script);
tests/test_install.py does the same with the built wheel."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpuwatch.cli import main
from gpuwatch.service.layout import NODE_FILES
from tests.test_install import STOCK_UNITS, tree

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("systemctl") is None, reason="needs systemctl (Debian: systemd)")


def make_root(tmp_path: Path, prefix: str = "/opt/gpuwatch") -> Path:
    """A root with the stock units and a venv at `prefix` holding the shipped files."""
    root = tmp_path / "root"
    if STOCK_UNITS.is_dir():
        shutil.copytree(STOCK_UNITS, root / STOCK_UNITS.relative_to("/"), symlinks=True)
    venv = root / prefix.lstrip("/")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "gpuwatch").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "gpuwatch").chmod(0o755)
    share = venv / "share" / "gpuwatch"
    share.mkdir(parents=True)
    for node_file in NODE_FILES:
        shutil.copy(REPO / "systemd" / node_file.shipped, share / node_file.shipped)
    for directory in ("etc", "var/lib", "run"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    return root


def service(root: Path, *args: str, prefix: str = "/opt/gpuwatch") -> Result:
    return CliRunner().invoke(main, ["service", *args, "--root", str(root), "--prefix", prefix])


def test_install_then_uninstall_leaves_the_root_exactly_as_it_was(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    venv = root / "opt/gpuwatch"
    before = tree(root, venv)
    installed = service(root, "install")
    assert installed.exit_code == 0, installed.output
    assert installed.output.splitlines() == [
        "installed /etc/gpuwatch/gpuwatch.toml",
        "installed /etc/systemd/system/gpuwatch.socket",
        "installed /etc/systemd/system/gpuwatch.service",
        "linked /usr/local/bin/gpuwatch -> /opt/gpuwatch/bin/gpuwatch",
        "verified gpuwatch.socket, gpuwatch.service with systemd-analyze",
        "the monitoring assets are in /opt/gpuwatch/share/gpuwatch/monitoring: gpuwatch service assets --out DIR "
        "copies them for Prometheus",
        "next: edit /etc/gpuwatch/gpuwatch.toml if this is not an 8-GPU NVML node, then: "
        "systemctl enable --now gpuwatch.socket gpuwatch.service",
    ]
    assert (root / "etc/gpuwatch/gpuwatch.toml").read_bytes() == (REPO / "systemd/gpuwatch.toml").read_bytes()
    assert not (root / "etc/systemd/system/multi-user.target.wants").exists()  # not enabled without --now
    uninstalled = service(root, "uninstall")
    assert uninstalled.exit_code == 0, uninstalled.output
    assert tree(root, venv) == before
    assert sorted(p.name for p in (venv / "share/gpuwatch").iterdir()) == sorted(f.shipped for f in NODE_FILES)


def test_installing_twice_changes_nothing_the_second_time(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    assert service(root, "install", "--now").exit_code == 0
    manifest = (root / "opt/gpuwatch/share/gpuwatch/installed.json").read_text()
    again = service(root, "install", "--now")
    assert again.exit_code == 0 and not any(
        line.startswith(("installed", "linked")) for line in again.output.split("\n")
    )
    assert (root / "opt/gpuwatch/share/gpuwatch/installed.json").read_text() == manifest
    assert service(root, "uninstall").exit_code == 0
    assert not (root / "etc/systemd/system/multi-user.target.wants/gpuwatch.service").exists()


def test_a_unit_installed_by_hand_is_put_aside_and_put_back(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    unit = root / "etc/systemd/system/gpuwatch.service"
    unit.parent.mkdir(parents=True)
    unit.write_text((REPO / "systemd/gpuwatch.service").read_text().replace("MemoryMax=2G", "MemoryMax=3G"))
    before = tree(root, root / "opt/gpuwatch")
    installed = service(root, "install")
    assert "installed /etc/systemd/system/gpuwatch.service (the old one is kept in " in installed.output
    assert "MemoryMax=2G" in unit.read_text()
    uninstalled = service(root, "uninstall")
    assert "put back the /etc/systemd/system/gpuwatch.service that was there before" in uninstalled.output
    assert tree(root, root / "opt/gpuwatch") == before


def test_an_edited_config_is_never_overwritten_nor_removed_without_purge(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    config = root / "etc/gpuwatch/gpuwatch.toml"
    assert service(root, "install").exit_code == 0
    config.write_text(config.read_text().replace("expected_gpus = 8", "expected_gpus = 4"))
    again = service(root, "install")
    assert "kept /etc/gpuwatch/gpuwatch.toml as it is" in again.output and "expected_gpus = 4" in config.read_text()
    uninstalled = service(root, "uninstall")
    assert "kept /etc/gpuwatch/gpuwatch.toml: edited since install (--purge removes it)" in uninstalled.output
    assert config.exists()
    assert service(root, "install").exit_code == 0  # a config not of this install: kept, and not recorded
    assert json.loads((root / "opt/gpuwatch/share/gpuwatch/installed.json").read_text())["files"][0]["target"] == (
        "/etc/systemd/system/gpuwatch.socket"
    )
    (root / "var/lib/gpuwatch").mkdir()
    purged = service(root, "uninstall", "--purge")
    assert purged.exit_code == 0 and config.exists(), purged.output  # --purge removes only what install wrote
    assert not (root / "var/lib/gpuwatch").exists()


def test_another_prefix_is_written_into_the_unit(tmp_path: Path) -> None:
    root = make_root(tmp_path, "/srv/gw")
    assert service(root, "install", "--pcie-drill", prefix="/srv/gw").exit_code == 0
    unit = (root / "etc/systemd/system/gpuwatch.service").read_text()
    assert "ExecStart=/srv/gw/bin/gpuwatch run " in unit and "Documentation=file:/srv/gw/share/gpuwatch/" in unit
    assert "/opt/gpuwatch" not in unit
    drop_in = root / "etc/systemd/system/gpuwatch.service.d/pcie-drill.conf"
    assert drop_in.read_text() == (REPO / "systemd/pcie-drill.conf").read_text()
    assert os.readlink(root / "usr/local/bin/gpuwatch") == "../../../srv/gw/bin/gpuwatch"


@pytest.mark.parametrize(
    ("prefix", "fragment"),
    [("/opt/none", "--prefix /opt/none: no gpuwatch command at "), ("relative", "give the venv's absolute path")],
)
def test_a_wrong_prefix_is_one_line_and_changes_nothing(tmp_path: Path, prefix: str, fragment: str) -> None:
    root = make_root(tmp_path)
    before = tree(root, root / "nothing")
    done = service(root, "install", prefix=prefix)
    assert done.exit_code == 2 and fragment in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert tree(root, root / "nothing") == before


def test_a_unit_systemd_analyze_rejects_fails_the_install_naming_it(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    root = make_root(tmp_path)
    shipped = root / "opt/gpuwatch/share/gpuwatch/gpuwatch.service"
    shipped.write_text(shipped.read_text().replace("ProtectSystem=strict", "ProtectSystem=stirct"))
    done = service(root, "install", "--now")
    assert done.exit_code == 2, done.output
    (line,) = done.stderr.strip().splitlines()
    assert "systemd-analyze verify: " in line and "stirct" in line and "gpuwatch service uninstall" in line
    assert not (root / "etc/systemd/system/multi-user.target.wants").exists()  # never enabled
    assert service(root, "uninstall").exit_code == 0


def test_uninstall_with_nothing_installed_says_so(tmp_path: Path) -> None:
    done = service(make_root(tmp_path), "uninstall")
    assert done.exit_code == 2 and "installed nothing here" in done.stderr
