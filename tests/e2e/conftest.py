"""Fixtures for end-to-end tests: a real `gpuwatch run` process on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess


@pytest.fixture
def demo_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path, "--sim-scenario", "demo", "--interval", "1") as daemon:
        yield daemon
