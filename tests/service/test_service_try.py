"""`gpuwatch service install` tried safely: --dry-run changes nothing and says every change; --root works on an
empty directory (or says in one line what it needs); install never writes through a link nor into a directory
others can write."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.cli import main
from gpuwatch.service.layout import NODE_FILES
from tests.service.test_service import REPO, make_root, service
from tests.test_install import tree

pytestmark = pytest.mark.skipif(shutil.which("systemctl") is None, reason="needs systemctl (Debian: systemd)")


def venv_only_root(tmp_path: Path) -> Path:
    """An empty directory but for the venv at /opt/gpuwatch (a stand-in: the shipped files, a gpuwatch script)."""
    root = tmp_path / "empty"
    share = root / "opt/gpuwatch/share/gpuwatch"
    share.mkdir(parents=True)
    (root / "opt/gpuwatch/bin").mkdir()
    (root / "opt/gpuwatch/bin/gpuwatch").write_text("#!/bin/sh\nexit 0\n")
    (root / "opt/gpuwatch/bin/gpuwatch").chmod(0o755)
    for node_file in NODE_FILES:
        shutil.copy(REPO / "systemd" / node_file.shipped, share / node_file.shipped)
    return root


@pytest.mark.parametrize("now", [False, True])
def test_dry_run_says_every_file_link_and_unit_and_changes_nothing(tmp_path: Path, now: bool) -> None:
    root = make_root(tmp_path)
    before = tree(root, root / "nothing")

    done = service(root, "install", "--dry-run", *(["--now"] if now else []))

    print(done.output, end="")
    assert done.exit_code == 0, done.output
    assert tree(root, root / "nothing") == before
    enable = (
        "would enable gpuwatch.socket, gpuwatch.service (not started)"
        if now
        else "would enable nothing (then: systemctl enable --now gpuwatch.socket gpuwatch.service)"
    )
    assert done.output.splitlines() == [
        "would make directory /etc/gpuwatch",
        "would write /etc/gpuwatch/gpuwatch.toml (mode 644)",
        "would make directory /etc/systemd",
        "would make directory /etc/systemd/system",
        "would write /etc/systemd/system/gpuwatch.socket (mode 644)",
        "would write /etc/systemd/system/gpuwatch.service (mode 644)",
        "would make directory /usr/local",
        "would make directory /usr/local/bin",
        "would link /usr/local/bin/gpuwatch -> /opt/gpuwatch/bin/gpuwatch",
        "would write /opt/gpuwatch/share/gpuwatch/installed.json (the record `gpuwatch service uninstall` undoes)",
        "would verify gpuwatch.socket, gpuwatch.service with systemd-analyze",
        enable,
        "dry run: nothing was changed",
    ]


def test_root_on_an_empty_directory_names_the_venv_it_needs_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()

    done = CliRunner().invoke(main, ["service", "install", "--root", str(empty)])  # this venv: outside --root

    print(done.stderr, end="")
    assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr == (
        f"gpuwatch service: error: --root {empty}: the venv to install from must be inside it, make one with the "
        f"wheel: python3 -m venv {empty}/opt/gpuwatch && {empty}/opt/gpuwatch/bin/pip install ./gpuwatch_daemon-*.whl,"
        f" then run {empty}/opt/gpuwatch/bin/gpuwatch service install --root {empty}\n"
    )
    assert list(empty.iterdir()) == []
    assert not Path(sys.prefix).resolve().is_relative_to(empty)


def test_root_on_an_empty_directory_with_the_venv_installs_and_says_why_it_did_not_verify(tmp_path: Path) -> None:
    root = venv_only_root(tmp_path)

    done = service(root, "install")

    print(done.output, end="")
    assert done.exit_code == 0, done.output
    assert (
        f"not verified: {root} has no systemd units of its own (no /usr/lib/systemd/system/sysinit.target), which "
        "systemd-analyze verify resolves ours against; it verifies once systemd is installed in that root"
    ) in done.output.splitlines()
    assert (root / "etc/systemd/system/gpuwatch.service").is_file() and (root / "etc/gpuwatch/gpuwatch.toml").is_file()
    assert service(root, "uninstall").exit_code == 0


def test_a_link_planted_at_the_temp_name_is_not_followed(tmp_path: Path) -> None:
    root = venv_only_root(tmp_path)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("root's own file\n")
    (units / ".gpuwatch.service.gpuwatch-new").symlink_to(victim)  # the name install wrote through before

    assert service(root, "install").exit_code == 0

    assert victim.read_text() == "root's own file\n"
    assert (units / "gpuwatch.service").read_bytes() == (REPO / "systemd/gpuwatch.service").read_bytes()
    assert not list(units.glob(".gpuwatch.service.*.gpuwatch-new"))  # no temp file left


@pytest.mark.parametrize(("mode", "who"), [(0o777, "others"), (0o775, "its group")])
def test_a_target_directory_others_can_write_is_refused_in_one_line(tmp_path: Path, mode: int, who: str) -> None:
    root = venv_only_root(tmp_path)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    units.chmod(mode)

    done = service(root, "install")

    print(done.stderr, end="")
    assert done.exit_code == 2
    assert done.stderr == (
        f"gpuwatch service: error: refusing to write into {units}: it is writable by {who} (mode {mode:o}); "
        "it must be root's and writable by root alone\n"
    )
    assert list(units.iterdir()) == []
