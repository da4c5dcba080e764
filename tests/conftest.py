"""Shared fixtures, the `gpu` marker gate, and a suite that never reads the host's gpuwatch config."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.node.runtime import RuntimeDir

# Every load() without an explicit path, in this process and in every child that inherits the environment,
# reads this empty file instead of a node's /etc/gpuwatch/gpuwatch.toml (.ci/run puts a decoy there to prove it).
_NO_CONFIG = Path(tempfile.mkdtemp(prefix="gpuwatch-tests-")) / "empty.toml"
_NO_CONFIG.write_text("")
atexit.register(shutil.rmtree, _NO_CONFIG.parent, True)
os.environ["GPUWATCH_CONFIG"] = str(_NO_CONFIG)
# Host snapshots of the tests' jobs, and what the tests' daemons prune, stay out of the machine's /dev/shm.
_SNAPSHOTS = _NO_CONFIG.parent / "shm"
_SNAPSHOTS.mkdir()
os.environ["GPUWATCH_SNAPSHOT_ROOT"] = str(_SNAPSHOTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run only with GPUWATCH_TEST_GPU=1 (on the H200 machines)."""
    if os.environ.get("GPUWATCH_TEST_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU: set GPUWATCH_TEST_GPU=1 on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def serve_reports() -> Iterator[Callable[[Path], RuntimeDir]]:
    """`serve_reports(path)`: the daemon's side of the trainer contract in `path` (status.json, report socket)."""
    served: list[RuntimeDir] = []

    def serve(path: Path) -> RuntimeDir:
        runtime = RuntimeDir(path)
        runtime.prepare()
        served.append(runtime)
        return runtime

    yield serve
    for runtime in served:
        runtime.close()
