"""What a node install consists of, where each piece comes from in the wheel, and where it goes.

The wheel installs its data under `<venv>/share/gpuwatch/` (pyproject's hatch shared-data). Paths on the node
are written as on a live system (`/etc/...`); `Root` maps them into the file system being installed, which is
`/` on a node and a scratch tree in a test or an image build.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.errors import ServiceError

SHARE = Path("share") / "gpuwatch"  # under the venv (the prefix)
DEFAULT_PREFIX = "/opt/gpuwatch"  # the venv the shipped unit's ExecStart= and links name; replaced by the real one


@dataclass(frozen=True)
class NodeFile:
    """One file `service install` puts on the node.

    `shipped` is its name under share/gpuwatch/, `target` its absolute path on the node. A `unit` is verified
    with systemd-analyze, enabled and started with --now, stopped and disabled at uninstall. `templated` files
    name the venv: /opt/gpuwatch in them becomes the prefix. An operator's edit of a `keep_edited` file is never
    overwritten, and a `keep_edited` file that was there before is left as it is. `only_with` names the install
    option a file needs (the pcie_remove drill's drop-in loosens the sandbox on nodes that opt in).
    """

    shipped: str
    target: str
    mode: int = 0o644
    unit: bool = False
    templated: bool = False
    keep_edited: bool = False
    only_with: str = ""


NODE_FILES: tuple[NodeFile, ...] = (
    NodeFile("gpuwatch.toml", "/etc/gpuwatch/gpuwatch.toml", keep_edited=True),
    # The socket unit first: enabled and started before the service, it holds the port and the control socket.
    NodeFile("gpuwatch.socket", "/etc/systemd/system/gpuwatch.socket", unit=True),
    NodeFile("gpuwatch.service", "/etc/systemd/system/gpuwatch.service", unit=True, templated=True),
    NodeFile("pcie-drill.conf", "/etc/systemd/system/gpuwatch.service.d/pcie-drill.conf", only_with="pcie_drill"),
)
# The command on root's PATH: a relative link into the venv, so it resolves in an image root as on the node.
COMMAND_LINK = "/usr/local/bin/gpuwatch"

# The monitoring assets, under share/gpuwatch/monitoring/ in the wheel; `service assets --out DIR` copies them.
MONITORING = Path("monitoring")
MONITORING_FILES: tuple[str, ...] = (
    "RUNBOOK.md",
    "prometheus/gpuwatch-alerts.yml",
    "prometheus/gpuwatch-recording.yml",
    "prometheus/prometheus.yml",
    "alertmanager/alertmanager.yml",
    "grafana/gpuwatch.json",
)
# The runbook the shipped alert rules and dashboard link to: the copy in the wheel on a node with the default
# prefix. `service assets` points the links at its own copy, or at a published one (--runbook-url).
SHIPPED_RUNBOOK_URL = f"file://{DEFAULT_PREFIX}/{SHARE}/{MONITORING}/RUNBOOK.md"


@dataclass(frozen=True)
class Root:
    """The file system being installed into: `/` on a node, a directory standing for it otherwise."""

    path: Path

    @property
    def live(self) -> bool:
        """The running system's own `/`: the one systemctl can start and stop units in."""
        return self.path.resolve() == Path("/")

    def __truediv__(self, absolute: str | Path) -> Path:
        """Where the node path `absolute` (/etc/...) is in this root."""
        return self.path / str(absolute).lstrip("/")

    def inside(self, real: Path) -> Path:
        """The node path of `real`, a path in this root.

        Raises:
            ServiceError: `real` is not in the root.
        """
        try:
            return Path("/") / real.resolve().relative_to(self.path.resolve())
        except ValueError:
            raise ServiceError(f"{real} is not under --root {self.path}: pass --prefix as the root sees it") from None


def prefix_of(root: Root, prefix: str | None) -> Path:
    """The venv to install from, as a node path: `prefix`, else the one this gpuwatch runs from.

    Raises:
        ServiceError: it holds no gpuwatch command or no shipped files (not a wheel install).
    """
    if prefix is None and not root.live and not Path(sys.prefix).resolve().is_relative_to(root.path.resolve()):
        raise ServiceError(f"--root {root.path}: the venv to install from must be inside it, {_make_venv(root)}")
    node_prefix = Path(prefix) if prefix else root.inside(Path(sys.prefix))
    if not node_prefix.is_absolute():
        raise ServiceError(f"--prefix {prefix}: give the venv's absolute path, e.g. {DEFAULT_PREFIX}")
    command = root / node_prefix / "bin" / "gpuwatch"
    if not os.access(command, os.X_OK):
        raise ServiceError(f"--prefix {node_prefix}: no gpuwatch command at {command}; {_make_venv(root, node_prefix)}")
    share = root / node_prefix / SHARE
    missing = [f.shipped for f in NODE_FILES if not (share / f.shipped).is_file()]
    if missing:
        raise ServiceError(f"{share} lacks {', '.join(missing)}: {_make_venv(root, node_prefix)}")
    return node_prefix


def _make_venv(root: Root, node_prefix: Path = Path(DEFAULT_PREFIX)) -> str:
    """The commands that make a venv at `node_prefix` in `root` with the wheel, and run its install."""
    venv = root / node_prefix
    again = "" if root.live else f" --root {root.path}"
    if node_prefix != Path(DEFAULT_PREFIX):
        again += f" --prefix {node_prefix}"
    return (
        f"make one with the wheel: python3 -m venv {venv} && {venv}/bin/pip install ./gpuwatch_daemon-*.whl, "
        f"then run {venv}/bin/gpuwatch service install{again}"
    )
