"""kill -9 at random moments during quarantine/release traffic: no acknowledged operation is lost.

A real `gpuwatch run --backend sim` takes quarantines and releases through the API from one
client while a timer SIGKILLs it at a random moment; it is restarted on the same state
directory, and every GPU must be exactly as the last operation answered 200 left it. The one
operation in flight at the kill (sent, not answered) may have landed or not: either is right.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

KILLS = 20
GPUS = 4
SIM_ARGS = ("--sim-gpus", str(GPUS), "--sim-scenario", "healthy", "--interval", "1")
Expected = tuple[bool, str | None]  # quarantined, reason


def gpu_states(node: DaemonProcess) -> dict[int, Expected]:
    gpus = node.get("/v1/gpus")["gpus"]
    return {g["index"]: (g["quarantined"], g["quarantine_reason"]) for g in gpus}


def traffic_until_killed(
    node: DaemonProcess, rng: random.Random, expected: dict[int, Expected], seq: list[int]
) -> tuple[int, int | None, Expected | None]:
    """Send operations until the daemon dies; (acknowledged count, GPU in flight, its state had it landed)."""
    token = (node.state_dir / "token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=10)
    acked = 0
    while True:
        gpu = rng.randrange(GPUS)
        seq[0] += 1
        quarantine = rng.random() < 0.6
        reason = f"op-{seq[0]}"
        was = expected[gpu]
        if quarantine:
            would: Expected = was if was[0] else (True, reason)
        else:
            would = (False, None)
        path = f"/v1/gpus/{gpu}/{'quarantine' if quarantine else 'release'}"
        try:
            conn.request("POST", path, json.dumps({"reason": reason}), headers)
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            return acked, gpu, would
        assert response.status == 200, body
        got = json.loads(body)
        assert (got["quarantined"], got["quarantine_reason"]) == would
        expected[gpu] = would
        acked += 1


def test_kill_9_loses_no_acknowledged_operation(tmp_path: Path) -> None:
    seed = int(os.environ.get("GPUWATCH_KILL9_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    node = DaemonProcess(tmp_path, *SIM_ARGS).start()
    expected = gpu_states(node)
    seq = [0]
    total = 0
    try:
        for kill in range(KILLS):
            timer = threading.Timer(rng.uniform(0.02, 0.4), node.process.send_signal, (signal.SIGKILL,))
            timer.start()
            acked, in_flight, would = traffic_until_killed(node, rng, expected, seq)
            timer.join()
            node.process.wait(timeout=10)
            assert node.process.returncode == -signal.SIGKILL
            total += acked
            node = DaemonProcess(tmp_path, *SIM_ARGS).start()
            actual = gpu_states(node)
            for gpu in range(GPUS):
                allowed = {expected[gpu]} | ({would} if gpu == in_flight and would is not None else set())
                assert actual[gpu] in allowed, (
                    f"seed {seed}, kill {kill + 1}: GPU {gpu} is {actual[gpu]}, acknowledged {expected[gpu]}"
                )
            expected = actual
    finally:
        node.process.kill()
        node.process.wait(timeout=10)
    print(f"kill -9 x{KILLS} (seed {seed}): {total} acknowledged operations, 0 lost")
    assert total >= KILLS, "the kills fell during traffic, not before it"
