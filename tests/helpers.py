"""Test helpers: a Daemon on the sim backend in a temp dir, driven tick by tick; metrics, Slurm and job stand-ins."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from gpuwatch.base.clock import ManualClock
from gpuwatch.config import Config, load
from gpuwatch.daemon import Daemon
from gpuwatch.testing.daemon_process import child_env
from tests.reporting import FakeRank

T0 = 1_800_000_000.0
HEALTHY_TRACE = Path(__file__).parent / "data" / "h200-healthy-workload.jsonl"  # copy of shared/traces' H200 trace
REPO = Path(__file__).resolve().parents[1]


# The fake ranks (tests.reporting.FakeRank) sleep with a fixed step while fake time runs: to the hang
# rules they are frozen after trainer.hang_frozen_after_s. Tests about something else keep that away.
NO_FROZEN_RANKS = {"trainer.hang_frozen_after_s": 1e6}


def sim_config(tmp_path: Path, scenario: str = "healthy", gpus: int = 8, **overrides: Any) -> Config:
    """A sim daemon's config in `tmp_path` (interval 5 s; fake ranks never frozen unless `overrides` say)."""
    config_path = tmp_path / "none.toml"
    config_path.write_text("")
    return load(
        config_path,
        environ={},
        overrides={
            "backend": "sim",
            "sim.scenario": scenario,
            "sim.gpus": gpus,
            "state_dir": str(tmp_path / "state"),
            "runtime_dir": str(tmp_path / "run"),
            "interval_s": 5.0,
            **NO_FROZEN_RANKS,
            **overrides,
        },
    )


@dataclass
class SimNode:
    """A daemon on the sim backend with a fake clock and an in-process HTTP client."""

    daemon: Daemon
    clock: ManualClock
    client: TestClient

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.daemon.token}"}

    def run_for(self, seconds: float, step: float = 5.0) -> None:
        """Tick every `step` seconds of fake time; events the sim schedules are judged as they fall due."""
        elapsed = 0.0
        monitor = self.daemon.monitor
        while elapsed < seconds:
            self.clock.advance(step)
            elapsed += step
            monitor.handle_events(monitor.backend.wait_events(0.0))
            monitor.tick()

    def gpu(self, index: int) -> dict[str, Any]:
        response = self.client.get(f"/v1/gpus/{index}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def report(self, process: FakeRank, gpu: int, job: str = "job", **fields: Any) -> bool:
        """What TrainerLink sends for a rank on `gpu`, stamped with the fake clock unless `t` is given."""
        body = {"t": self.clock.t, "job_id": job, "gpu_uuid": self.daemon.monitor.statics[gpu].uuid, **fields}
        return process.report(self.daemon.config.runtime_dir, **body)

    def incidents(self) -> list[dict[str, Any]]:
        """Every incident the daemon recorded, newest first."""
        return list(self.client.get("/v1/incidents?limit=1000").json()["incidents"])

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()


def start_sim_node(
    tmp_path: Path, scenario: str = "healthy", gpus: int = 8, *, t0: float = T0, **overrides: Any
) -> SimNode:
    """A sim daemon whose clock starts at `t0` (T0; `time.time()` where real processes' times meet it)."""
    clock = ManualClock(t0)
    daemon = Daemon(sim_config(tmp_path, scenario, gpus, **overrides), clock=clock)
    daemon.backend.clock = clock  # type: ignore[attr-defined]  # the sim's scripted events follow test time
    daemon.monitor.tick()
    return SimNode(daemon, clock, TestClient(daemon.app(), base_url="http://127.0.0.1"))


def wait_for(what: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """`what()`'s first truthy answer within `timeout_s` (real time: the daemon's remediation thread acts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"timed out; last: {what()}")


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples named `name` in a Prometheus exposition, as (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def metric_value(text: str, name: str) -> float:
    """The value of the one sample named `name` in a Prometheus exposition."""
    samples = metric_samples(text, name)
    assert len(samples) == 1, (name, samples)
    return samples[0][1]


def fake_scontrol(directory: Path) -> tuple[str, Path]:
    """An scontrol stand-in for one node, where a real Slurm would be beside the point; (program, node file).

    `show` prints the node (IDLE, or what the last drain wrote to the node file); `update …
    State=DRAIN Reason=…` writes it, `State=RESUME` removes it. tests/e2e/slurmctl.py runs the real one.
    """
    node_file = directory / "node"
    program = directory / "scontrol"
    program.write_text(
        f"""#!/bin/sh
case "$1" in
show) if [ -f {node_file} ]; then cat {node_file}; else printf 'NodeName=n\\n   State=IDLE\\n'; fi;;
update) case "$3" in
  State=DRAIN) printf 'NodeName=n\\n   State=IDLE+DRAIN\\n   Reason=%s [root@now]\\n' "${{4#Reason=}}" > {node_file};;
  State=RESUME) rm -f {node_file};;
  esac;;
esac
"""
    )
    program.chmod(0o755)
    return str(program), node_file


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of `gpuwatch launch` and its job in a test: no GPUWATCH_* and no TORCHELASTIC_* from outside,
    no CUDA_VISIBLE_DEVICES (launch sets it), and this checkout's gpuwatch for the ranks torchrun starts."""
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return {**env, "PYTHONPATH": str(REPO), **extra}
