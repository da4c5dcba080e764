"""`gpuwatch service install` and `uninstall`: the node's files from the wheel, a manifest, and systemctl.

Install writes only what is missing or differs, and records in a manifest (in the venv, beside the shipped
files) each file it wrote, the file it replaced (kept aside, put back at uninstall), each directory it made,
the command link and the units it enabled. Uninstall undoes exactly that: it removes a file only while it is
as install wrote it (an edited config is kept, and said so, unless --purge) and a directory only if empty.
systemctl starts and stops units only on the running system; in another root (an image, a test) units are
enabled offline (`systemctl --root`), and nothing is started.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuwatch.base.tools import run_tool
from gpuwatch.errors import ServiceError
from gpuwatch.service.layout import COMMAND_LINK, DEFAULT_PREFIX, MONITORING, NODE_FILES, SHARE, NodeFile, Root

MANIFEST = "installed.json"  # in <prefix>/share/gpuwatch/
REPLACED = "replaced"  # <prefix>/share/gpuwatch/replaced/: files install put aside
SYSTEMCTL_TIMEOUT_S = 180.0  # `enable --now` waits for READY=1, after the first sample of every GPU
DAEMON_DIRS = ("/var/lib/gpuwatch", "/var/cache/gpuwatch", "/run/gpuwatch")  # systemd makes them; --purge removes
Say = Callable[[str], None]


@dataclass
class Written:
    """A file install wrote: its content's sha256 then, and where the file it replaced was put (or None)."""

    target: str
    sha256: str
    backup: str | None = None


@dataclass
class Manifest:
    prefix: str
    files: list[Written] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)  # made by install, in the order made
    link: str | None = None
    enabled: list[str] = field(default_factory=list)

    def written(self, target: str) -> Written | None:
        return next((w for w in self.files if w.target == target), None)


def install(root: Root, prefix: Path, *, now: bool, pcie_drill: bool, say: Say, dry_run: bool = False) -> None:
    """Put the node's files in place (see the module), verify the units; with `now`, enable and start them.

    `dry_run`: say each file it would write, put aside, link or enable, and change nothing.

    Raises:
        ServiceError: not root, a file could not be written, systemd-analyze or systemctl refused.
    """
    if not dry_run:
        _require_root(root)
    share = root / prefix / SHARE
    manifest = _load(share) or Manifest(str(prefix))
    wanted = [f for f in NODE_FILES if not f.only_with or (f.only_with == "pcie_drill" and pcie_drill)]
    units = [Path(f.target).name for f in wanted if f.unit]
    if dry_run:
        _dry_run(root, share, prefix, wanted, manifest, now, say)
        return
    try:
        for node_file in wanted:
            _place(root, share, prefix, node_file, manifest, say)
        _link(root, prefix, manifest, say)
    finally:
        _save(share, manifest)
    _verify(root, [f.target for f in wanted if f.unit], say)
    if root.live and _systemd_running():
        _systemctl(root, "daemon-reload")
    config = next(f.target for f in NODE_FILES if f.keep_edited)
    monitoring = prefix / SHARE / MONITORING
    say(f"the monitoring assets are in {monitoring}: gpuwatch service assets --out DIR copies them for Prometheus")
    if not now:
        say(f"next: edit {config} if this is not an 8-GPU NVML node, then: {enable_command(units)}")
        return
    _enable(root, units, manifest, say)
    _save(share, manifest)


def enable_command(units: list[str]) -> str:
    """What starts the service by hand: both units, the socket first (it holds the port)."""
    return f"systemctl enable --now {' '.join(units)}"


def _dry_run(
    root: Root, share: Path, prefix: Path, wanted: list[NodeFile], manifest: Manifest, now: bool, say: Say
) -> None:
    """Say, one line each, what install would write, put aside, make, link, verify and enable; change nothing."""
    made: set[Path] = set()

    def make_parents(node_path: str) -> None:
        for directory in reversed([d for d in Path(node_path).parents if not (root / d).exists()]):
            if directory not in made:
                made.add(directory)
                say(f"would make directory {directory}")

    for node_file in wanted:
        target = root / node_file.target
        content = _content(share, prefix, node_file)
        recorded = manifest.written(node_file.target)
        if target.exists() or target.is_symlink():
            if node_file.keep_edited and (recorded is None or _sha256(target) != recorded.sha256):
                say(f"would keep {node_file.target} as it is")
                continue
            if target.is_file() and target.read_bytes() == content:
                say(f"would leave {node_file.target}: already as shipped")
                continue
            aside = f", putting the old one aside in {prefix / SHARE / REPLACED}" if recorded is None else ""
            say(f"would write {node_file.target} (mode {node_file.mode:o}){aside}")
            continue
        make_parents(node_file.target)
        say(f"would write {node_file.target} (mode {node_file.mode:o})")
    link = root / COMMAND_LINK
    if not (link.is_symlink() and _resolves_into(link, root / prefix)):
        if link.exists() or link.is_symlink():
            say(f"would leave {COMMAND_LINK} as it is (it is not this install's)")
        else:
            make_parents(COMMAND_LINK)
            say(f"would link {COMMAND_LINK} -> {prefix}/bin/gpuwatch")
    say(f"would write {prefix / SHARE / MANIFEST} (the record `gpuwatch service uninstall` undoes)")
    units = [Path(f.target).name for f in wanted if f.unit]
    reason = _why_not_verified(root)
    say(f"would verify {', '.join(units)} with systemd-analyze" if reason is None else f"would not verify: {reason}")
    if now:
        live = root.live and _systemd_running()
        say(f"would {'enable and start' if live else 'enable'} {', '.join(units)}" + ("" if live else " (not started)"))
    else:
        say(f"would enable nothing (then: {enable_command(units)})")
    say("dry run: nothing was changed")


def uninstall(root: Root, prefix: Path, *, purge: bool, say: Say) -> None:
    """Undo what install recorded: stop and disable its units, remove its files, link and empty directories.

    With `purge` also files edited since, and the daemon's state, cache and runtime directories.

    Raises:
        ServiceError: not root, nothing recorded, or systemctl refused.
    """
    _require_root(root)
    share = root / prefix / SHARE
    manifest = _load(share)
    if manifest is None:
        raise ServiceError(f"no {share / MANIFEST}: `gpuwatch service install` from {prefix} installed nothing here")
    for unit in reversed(manifest.enabled):
        _disable(root, unit, say)
    for written in reversed(manifest.files):
        _remove(root, share, written, purge, say)
    if manifest.link is not None:
        link = root / manifest.link
        if link.is_symlink() and _resolves_into(link, root / prefix):
            link.unlink()
            say(f"removed {manifest.link}")
    if purge:
        for directory in DAEMON_DIRS:
            if (root / directory).exists():
                shutil.rmtree(root / directory)
                say(f"removed {directory} (quarantines, the API token, the runtime dir)")
    for directory in reversed(manifest.dirs):
        with contextlib.suppress(OSError):  # not empty: something else lives there now
            (root / directory).rmdir()
    with contextlib.suppress(OSError):
        (share / REPLACED).rmdir()
    (share / MANIFEST).unlink()
    if root.live and _systemd_running():
        _systemctl(root, "daemon-reload")
    if not purge and (root / DAEMON_DIRS[0]).exists():
        say(f"left {DAEMON_DIRS[0]} (quarantines, the API token): `gpuwatch service uninstall --purge` removes it")


# --- files ----------------------------------------------------------------------------------------


def _place(root: Root, share: Path, prefix: Path, node_file: NodeFile, manifest: Manifest, say: Say) -> None:
    """Write one file unless it is there as wanted; an unrecorded different file is put aside first."""
    content = _content(share, prefix, node_file)
    target = root / node_file.target
    recorded = manifest.written(node_file.target)
    if target.exists() or target.is_symlink():
        if node_file.keep_edited:  # an operator's config: never overwritten
            if recorded is None or _sha256(target) != recorded.sha256:
                example = prefix / SHARE / node_file.shipped
                say(f"kept {node_file.target} as it is (every key with its default: {example})")
                return
        if target.is_file() and target.read_bytes() == content:
            return
        if recorded is None:
            recorded = Written(node_file.target, "", _put_aside(target, share, node_file.target))
            manifest.files.append(recorded)
    else:
        _make_parents(root, Path(node_file.target).parent, manifest)
        if recorded is None:
            recorded = Written(node_file.target, "")
            manifest.files.append(recorded)
    _write(target, content, node_file.mode)
    recorded.sha256 = hashlib.sha256(content).hexdigest()
    say(f"installed {node_file.target}" + (f" (the old one is kept in {share / REPLACED})" if recorded.backup else ""))


def _content(share: Path, prefix: Path, node_file: NodeFile) -> bytes:
    """The shipped file as this prefix wants it (the unit names the venv's gpuwatch)."""
    content = (share / node_file.shipped).read_bytes()
    if node_file.templated and str(prefix) != DEFAULT_PREFIX:
        content = content.replace(DEFAULT_PREFIX.encode(), str(prefix).encode())
    return content


def _remove(root: Root, share: Path, written: Written, purge: bool, say: Say) -> None:
    target = root / written.target
    if not target.exists():
        return
    if _sha256(target) != written.sha256 and not purge:
        say(f"kept {written.target}: edited since install (--purge removes it)")
        return
    target.unlink()
    if written.backup is not None:
        os.replace(share / REPLACED / written.backup, target)
        say(f"put back the {written.target} that was there before")
    else:
        say(f"removed {written.target}")


def _put_aside(target: Path, share: Path, node_path: str) -> str:
    name = node_path.strip("/").replace("/", "__")
    (share / REPLACED).mkdir(mode=0o700, exist_ok=True)
    os.replace(target, share / REPLACED / name)
    return name


def _make_parents(root: Root, directory: Path, manifest: Manifest) -> None:
    missing = [d for d in (directory, *directory.parents) if not (root / d).exists()]
    for node_dir in reversed(missing):
        (root / node_dir).mkdir(mode=0o755)
        manifest.dirs.append(str(node_dir))


def _write(target: Path, content: bytes, mode: int) -> None:
    """Replace `target` atomically (a half-written unit must never be what systemd reads), never through a link.

    The temp file is new (O_CREAT|O_EXCL|O_NOFOLLOW, a name nobody can guess) in the target's own directory,
    which must be ours alone: a directory another user can write could swap the file under us.

    Raises:
        ServiceError: the directory is not root's (or ours) or others can write it.
    """
    _require_private_dir(target.parent)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".gpuwatch-new")
    try:
        os.fchmod(fd, mode)
        os.write(fd, content)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    os.replace(temp, target)


def _require_private_dir(directory: Path) -> None:
    """ServiceError, one line, unless `directory` is a real directory of root's (or ours) that only its owner
    can write."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise ServiceError(f"{directory}: {exc.strerror or exc}") from None
    owners = {0, os.geteuid()}
    why = (
        "not a directory" if not stat.S_ISDIR(st.st_mode)
        else f"owned by uid {st.st_uid}" if st.st_uid not in owners
        else f"writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode {stat.S_IMODE(st.st_mode):o})"
        if st.st_mode & 0o022 else None
    )  # fmt: skip
    if why is not None:
        raise ServiceError(
            f"refusing to write into {directory}: it is {why}; it must be root's and writable by root alone"
        )


def _link(root: Root, prefix: Path, manifest: Manifest, say: Say) -> None:
    """`gpuwatch` on root's PATH, as a relative link into the venv (it resolves in an image root too)."""
    link, command = root / COMMAND_LINK, root / prefix / "bin" / "gpuwatch"
    if link.is_symlink() and _resolves_into(link, root / prefix):
        return
    if link.exists() or link.is_symlink():
        say(f"left {COMMAND_LINK} as it is (it is not this install's); run {prefix}/bin/gpuwatch")
        return
    _make_parents(root, Path(COMMAND_LINK).parent, manifest)
    link.symlink_to(os.path.relpath(command, link.parent))
    manifest.link = COMMAND_LINK
    say(f"linked {COMMAND_LINK} -> {prefix}/bin/gpuwatch")


def _resolves_into(link: Path, directory: Path) -> bool:
    return link.resolve().is_relative_to(directory.resolve())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(share: Path) -> Manifest | None:
    try:
        data: dict[str, Any] = json.loads((share / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ServiceError(f"{share / MANIFEST}: cannot read it: {exc}") from None
    files = [Written(**entry) for entry in data.pop("files", [])]
    return Manifest(**data, files=files)


def _save(share: Path, manifest: Manifest) -> None:
    _write(share / MANIFEST, json.dumps(asdict(manifest), indent=2).encode(), 0o644)


def _require_root(root: Root) -> None:
    if root.live and os.geteuid() != 0:
        raise ServiceError("run it as root: it writes /etc/systemd/system and /etc/gpuwatch")


# --- systemd --------------------------------------------------------------------------------------


def _systemd_running() -> bool:
    """sd_booted(): systemd is PID 1 on this machine."""
    return Path("/run/systemd/system").is_dir()


def _systemctl(root: Root, *args: str, ok: tuple[int, ...] = (0,)) -> str:
    """systemctl on the running system, or offline on another root (`--root`); its stdout.

    Raises:
        ServiceError: it is missing, hung, or exited other than `ok`.
    """
    scope = () if root.live else (f"--root={root.path}",)
    done = run_tool(["systemctl", *scope, *args], SYSTEMCTL_TIMEOUT_S, error=ServiceError, setting="PATH")
    if done.returncode not in ok:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ServiceError(f"systemctl {' '.join(args)}: exit {done.returncode}: {said[-1] if said else 'no output'}")
    return done.stdout.strip()


def _enable(root: Root, units: list[str], manifest: Manifest, say: Say) -> None:
    live = root.live and _systemd_running()
    for unit in units:
        if _systemctl(root, "is-enabled", unit, ok=(0, 1)) != "enabled" and unit not in manifest.enabled:
            manifest.enabled.append(unit)
    if live:
        try:
            _systemctl(root, "enable", "--now", *units)
        except ServiceError as exc:
            raise ServiceError(f"{exc}; `journalctl -u {units[0]} -n 20` says why") from None
        say(f"enabled and started {', '.join(units)}: systemctl status {units[0]}")
        return
    _systemctl(root, "enable", *units)
    where = "in that root" if not root.live else "here: systemd is not running"
    say(f"enabled {', '.join(units)}; not started {where} (it starts at the next boot)")


def _disable(root: Root, unit: str, say: Say) -> None:
    live = root.live and _systemd_running()
    _systemctl(root, "disable", *(("--now",) if live else ()), unit)
    say(f"{'stopped and ' if live else ''}disabled {unit}")


def _verify(root: Root, units: list[str], say: Say) -> None:
    """systemd-analyze verify on the installed units with their drop-ins (in the root, ExecStart= too).

    Without systemd-analyze it is a warning.

    Raises:
        ServiceError: it complained about one of ours.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        say("warning: systemd-analyze not found: the unit was not verified")
        return
    reason = _why_not_verified(root)
    if reason is not None:
        say(f"not verified: {reason}")
        return
    scope = [] if root.live else [f"--root={root.path}"]
    argv = [analyze, "verify", "--man=no", *scope, *(str(root / unit) for unit in units)]
    done = run_tool(argv, 60.0, error=ServiceError, setting="PATH", what="systemd-analyze verify")
    ours = [line for line in _lines(done.stdout + done.stderr) if any(Path(u).name in line for u in units)]
    if ours:
        raise ServiceError(
            f"systemd-analyze verify: {ours[0]} (the files are in place: fix it and install again, "
            "or `gpuwatch service uninstall`)"
        )
    say(f"verified {', '.join(Path(u).name for u in units)} with systemd-analyze")


STOCK_UNIT_DIRS = ("usr/lib/systemd/system", "lib/systemd/system")


def _why_not_verified(root: Root) -> str | None:
    """Why systemd-analyze cannot verify the units in `root` (one line), or None when it can.

    It resolves the units the unit is ordered against (sysinit.target, ...) inside the root: an image
    without systemd's own units would fail on those, not on ours.
    """
    if shutil.which("systemd-analyze") is None:
        return "systemd-analyze not found"
    if root.live or any((root / d / "sysinit.target").exists() for d in STOCK_UNIT_DIRS):
        return None
    return (
        f"{root.path} has no systemd units of its own (no /usr/lib/systemd/system/sysinit.target), which "
        "systemd-analyze verify resolves ours against; it verifies once systemd is installed in that root"
    )


def _lines(text: str) -> Iterator[str]:
    return (line.strip() for line in text.splitlines() if line.strip())
