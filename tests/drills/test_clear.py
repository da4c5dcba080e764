"""Ending an injection early: DELETE /v1/injections/{id} and `gpuwatch drill --clear [GPU]` against a real daemon,
and what the monitor does with the drill mark when an injection ends before its time."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.base.clock import ManualClock
from gpuwatch.daemon import Daemon
from gpuwatch.testing.daemon_process import DaemonProcess, run_gpuwatch
from tests.helpers import T0, sim_config

pytestmark = pytest.mark.slow
SLOW_CLOCK = {"sm_clock_mhz": 500, "clocks_event_reasons": 0, "util_gpu_pct": 100}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    args = ("--sim-scenario", "healthy", "--sim-gpus", "2", "--interval", "1")
    with DaemonProcess(tmp_path_factory.mktemp("clear"), *args) as running:
        yield running


def call(daemon: DaemonProcess, method: str, path: str, body: dict[str, Any] | None = None, token: bool = True) -> Any:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {daemon.token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(daemon.url + path, data=data, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def inject(daemon: DaemonProcess, gpu: int, duration_s: float = 86400) -> int:
    body = {"fields": SLOW_CLOCK, "duration_s": duration_s}
    return int(call(daemon, "POST", f"/v1/gpus/{gpu}/inject", body)["id"])


def test_clear_ends_a_days_injection_on_one_gpu_and_the_readings_come_back(daemon: DaemonProcess) -> None:
    first, second = inject(daemon, 0), inject(daemon, 1)
    done = daemon.cli("drill", "--clear", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ended injection {second} on GPU 1 (sm_clock_mhz=500,clocks_event_reasons=0,")
    early = re.fullmatch(r".*\) (\d+) s early\n", done.stdout)
    assert early is not None and 86000 < int(early.group(1)) <= 86400, done.stdout  # about a day early
    assert [i["id"] for i in daemon.get("/v1/injections")["injections"]] == [first]
    again = daemon.cli("drill", "--clear", "1")
    assert (again.returncode, again.stdout) == (0, "no injection in force on GPU 1: nothing changed\n")
    everything = daemon.cli("drill", "--clear")
    assert everything.returncode == 0 and everything.stdout.startswith(f"ended injection {first} on GPU 0 ")
    assert daemon.get("/v1/injections")["injections"] == []
    assert _sm_clock_after_the_next_tick(daemon) != 500  # the readings are the GPU's own again


def _sm_clock_after_the_next_tick(daemon: DaemonProcess) -> int:
    seen = daemon.get("/v1/gpus/0")["sample"]["t"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sample = daemon.get("/v1/gpus/0")["sample"]
        if sample["t"] > seen:
            return int(sample["sm_clock_mhz"])
        time.sleep(0.2)
    raise AssertionError("no new sample")


def test_delete_needs_the_token_and_names_an_unknown_id(daemon: DaemonProcess) -> None:
    injection = inject(daemon, 0)
    with pytest.raises(urllib.error.HTTPError) as refused:
        call(daemon, "DELETE", f"/v1/injections/{injection}", token=False)
    assert refused.value.code == 401
    ended = call(daemon, "DELETE", f"/v1/injections/{injection}")
    assert (ended["id"], ended["gpu"], ended["fields"]) == (injection, 0, SLOW_CLOCK)
    with pytest.raises(urllib.error.HTTPError) as unknown:
        call(daemon, "DELETE", f"/v1/injections/{injection}")
    assert unknown.value.code == 404
    assert (
        json.loads(unknown.value.read())["detail"]
        == f"no injection {injection} is in force (GET /v1/injections lists them)"
    )


def test_clear_without_the_daemons_control_socket_is_one_line_and_ends_nothing(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    injection = inject(daemon, 1)
    done = run_gpuwatch("drill", "--clear", "--listen", daemon.listen, "--state-dir", str(tmp_path))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no control socket at" in done.stderr
    assert [i["id"] for i in daemon.get("/v1/injections")["injections"]] == [injection]
    call(daemon, "DELETE", f"/v1/injections/{injection}")


def test_the_drill_mark_ends_with_the_windows_from_the_early_end_not_from_the_planned_one(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    daemon = Daemon(sim_config(tmp_path, "healthy", gpus=2), clock=clock)
    try:
        monitor = daemon.monitor
        injection = monitor.inject(1, SLOW_CLOCK, 86400)
        clock.advance(10)
        ended = monitor.end_injection(injection.id)
        assert ended is not None and ended.until == clock.t and monitor.injections() == []
        assert monitor.end_injection(injection.id) is None
        clock.advance(monitor._keep_s + 1)
        assert monitor.tick().gpu(1).drill_active is False  # type: ignore[union-attr]
    finally:
        daemon.stop()
