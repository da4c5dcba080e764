"""Fixtures for drills: a sim daemon with its drills and a fake clock, an in-memory fake daemon
for the paths a sim cannot show (idle GPUs, trainers, incidents), and fake tools that record argv."""

from __future__ import annotations

import copy
import dataclasses
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from fastapi.testclient import TestClient

from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config, DrillSchedule
from gpuwatch.daemon import Daemon
from gpuwatch.drills.cli import drill
from gpuwatch.drills.service import DrillService
from gpuwatch.drills.steps import Clock
from gpuwatch.errors import DaemonError
from tests.helpers import T0, SimNode, sim_config
from tests.reporting import FakeRank


@click.group()
def main() -> None:
    """Stands in for gpuwatch.cli.main, which registers the command with `main.add_command(drill)`."""


main.add_command(drill)


def start_drill_node(
    tmp_path: Path, gpus: int = 4, schedule: tuple[DrillSchedule, ...] = (), **overrides: Any
) -> SimNode:
    """A sim daemon (healthy scenario) with its drills, before its app is built."""
    clock = ManualClock(T0)
    config = sim_config(tmp_path, "healthy", gpus, **overrides)
    config = dataclasses.replace(config, drills=dataclasses.replace(config.drills, schedule=schedule))
    daemon = Daemon(config, clock=clock)
    daemon.backend.clock = clock  # type: ignore[attr-defined]
    daemon.monitor.tick()
    return SimNode(daemon, clock, TestClient(daemon.app(), base_url="http://127.0.0.1"))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    node = start_drill_node(tmp_path)
    yield node
    node.close()


class ClientApi:
    """DrillApi over the sim daemon's in-process client, failing like HttpApi does."""

    def __init__(self, node: SimNode) -> None:
        self.node = node

    def _check(self, method: str, path: str, response: Any) -> Any:
        if response.status_code >= 400:
            raise DaemonError(f"{method} {path}: HTTP {response.status_code}: {response.json().get('detail')}")
        return response

    def get(self, path: str) -> Any:
        return self._check("GET", path, self.node.client.get(path)).json()

    def text(self, path: str) -> str:
        return str(self._check("GET", path, self.node.client.get(path)).text)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._check("POST", path, self.node.client.post(path, json=body, headers=self.node.auth)).json()

    def require_control(self) -> None:
        """The in-process client always holds the node's token."""


def drill_service(node: SimNode) -> DrillService:
    """The node's drills, pointed at its in-process client and fake clock."""
    service = node.daemon.drills
    service.drills.api = lambda: ClientApi(node)
    service.drills.clock = sim_clock(node)
    return service


def sim_clock(node: SimNode, poll_s: float = 1.0, hook: Callable[[], None] | None = None) -> Clock:
    """Drill time on the node's fake clock: each sleep advances it and samples when an interval is due."""
    interval = node.daemon.config.interval_s
    last = [node.clock.t]

    def sleep(seconds: float) -> None:
        node.clock.advance(seconds)
        monitor = node.daemon.monitor
        monitor.handle_events(monitor.backend.wait_events(0.0))
        if node.clock.t - last[0] >= interval:
            last[0] = node.clock.t
            monitor.tick()
        if hook is not None:
            hook()

    return Clock(node.clock, sleep, poll_s)


def fake_gpu(index: int, **changes: Any) -> dict[str, Any]:
    """One GPU as GET /v1/gpus/N shows it: healthy, idle, in service."""
    body: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-fake-{index}",
        "name": "NVIDIA H200",
        "pci_bus_id": f"00000000:{0x18 + 3 * index:02X}:00.0",
        "state": "healthy",
        "quarantined": False,
        "quarantine_reason": None,
        "epoch": 0,
        "findings": [],
        "error": None,
        "sample_age_s": 0.5,
        "sample": {"t": 0.0, "sm_clock_mhz": 1980, "pids": []},
        "trainers": [],
    }
    body.update(changes)
    return body


class FakeDaemon:
    """An in-memory daemon for drills: GPUs, incidents, metrics; records every POST.

    `react` runs after each POST and each clock step, so a test scripts how the "daemon" answers.
    """

    def require_control(self) -> None:
        """The fake takes any caller as authorised."""

    def __init__(self, gpus: list[dict[str, Any]], backend: str = "nvml") -> None:
        self.gpus = gpus
        self.backend = backend
        self.incidents: list[dict[str, Any]] = []
        self.metrics = ""
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.t = 1_000.0
        self.react: Callable[[FakeDaemon], None] = lambda daemon: None

    def gpu(self, index: int) -> dict[str, Any]:
        return next(g for g in self.gpus if g["index"] == index)

    def get(self, path: str) -> Any:
        if path == "/v1/gpus":
            return {"t": self.t, "backend": self.backend, "gpus": copy.deepcopy(self.gpus)}
        if path.startswith("/v1/gpus/"):
            index = int(path.rsplit("/", 1)[1])
            if not any(g["index"] == index for g in self.gpus):
                raise DaemonError(f"GET {path}: HTTP 404: no GPU with index {index}")
            return copy.deepcopy(self.gpu(index))
        if path == "/v1/incidents":
            return {"incidents": copy.deepcopy(self.incidents)}
        raise DaemonError(f"GET {path}: HTTP 404: Not Found")

    def text(self, path: str) -> str:
        assert path == "/metrics"
        return self.metrics

    def post(self, path: str, body: dict[str, Any]) -> Any:
        self.posts.append((path, body))
        answer: dict[str, Any] = {"ok": True}
        if path.endswith("/quarantine"):
            self.gpu(int(path.split("/")[3])).update(quarantined=True, quarantine_reason=body["reason"])
        elif path.endswith("/release") and path.startswith("/v1/gpus/"):
            self.gpu(int(path.split("/")[3])).update(quarantined=False, quarantine_reason=None)
        elif path.endswith("/inject"):
            answer = {"id": len(self.posts)}
        elif path == "/v1/backend/release":
            answer = {"released": True, "detail": "nvml released"}
        elif path == "/v1/backend/reacquire":
            answer = {"reacquired": True, "detail": "nvml open again"}
        self.react(self)
        return answer

    def paths(self) -> list[str]:
        return [path for path, _ in self.posts]

    def clock(self, poll_s: float = 1.0) -> Clock:
        def sleep(seconds: float) -> None:
            self.t += seconds
            for g in self.gpus:
                g["sample"] = {**(g["sample"] or {}), "t": self.t}
            self.react(self)

        return Clock(lambda: self.t, sleep, poll_s)


@dataclasses.dataclass
class Tools:
    """Fake nvidia-smi and dcgmi that append their argv to `calls`, and a fake sysfs tree."""

    root: Path
    nvidia_smi: Path
    dcgmi: Path
    calls: Path
    apps: Path
    sysfs: Path

    def argv(self) -> list[list[str]]:
        if not self.calls.exists():
            return []
        return [line.split("\t") for line in self.calls.read_text().splitlines()]

    def config(self, config: Config) -> Config:
        tools = dataclasses.replace(
            config.tools, nvidia_smi=str(self.nvidia_smi), dcgmi=str(self.dcgmi), sysfs_root=str(self.sysfs)
        )
        return dataclasses.replace(config, tools=tools)

    def fail_reset(self) -> None:
        (self.root / "reset_fails").write_text("1")


@pytest.fixture
def tools(tmp_path: Path) -> Tools:
    root = tmp_path / "tools"
    root.mkdir()
    calls, apps = root / "calls.txt", root / "compute_apps.csv"
    apps.write_text("")
    script = f"""#!/bin/sh
(IFS="$(printf '\\t')"; echo "$(basename "$0")$IFS$*") >> {calls}
case "$1" in
  --query-compute-apps=*) cat {apps} ;;
  -r) if [ -e {root}/reset_fails ]; then echo "Unable to reset GPU: In use by another client" >&2; exit 3; fi
      echo "GPU 00000000:18:00.0 was successfully reset." ;;
  test) echo "Successfully injected field info." ;;
esac
"""
    nvidia_smi, dcgmi = root / "nvidia-smi", root / "dcgmi"
    for path in (nvidia_smi, dcgmi):
        path.write_text(script)
        path.chmod(0o755)
    sysfs = tmp_path / "sys"
    for index in range(4):
        device = sysfs / "bus" / "pci" / "devices" / f"0000:{0x18 + 3 * index:02x}:00.0"
        device.mkdir(parents=True)
        (device / "remove").write_text("")
    (sysfs / "bus" / "pci" / "rescan").write_text("")
    return Tools(root, nvidia_smi, dcgmi, calls, apps, sysfs)


class Job:
    """Ranks of job-7 as real processes that report over the daemon's socket what `report` tells them."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.children: list[subprocess.Popen[str]] = []
        self._ranks: dict[int, FakeRank] = {}

    def rank(self, gpu: int, rank: int, step: int = 10, handler: str = "pass", **extra: Any) -> int:
        child = FakeRank(handler)
        self._adopt(child)
        self._ranks[child.pid] = child
        self.report(child.pid, gpu, rank, step, **extra)
        return child.pid

    def report(self, pid: int, gpu: int, rank: int, step: int, **extra: Any) -> None:
        body = {
            "t": self.node.clock.t,
            "rank": rank,
            "job_id": "job-7",
            "gpu_uuid": self.node.gpu(gpu)["uuid"],
            "step": step,
            "first_step": step,
            **extra,
        }
        self._ranks[pid].report(self.node.daemon.config.runtime_dir, **body)

    def _adopt(self, child: subprocess.Popen[str]) -> None:
        self.children.append(child)
        threading.Thread(target=child.wait, daemon=True).start()  # reaped as it dies

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()


@pytest.fixture
def job(node: SimNode) -> Iterator[Job]:
    job = Job(node)
    yield job
    job.stop()
